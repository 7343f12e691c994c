#!/usr/bin/env bash
# Session 30: one configuration's runs through benchmarks/gpu/issue5_host.sh (CONFIG, NPROC, ITERS, RUN_TIMEOUT,
# VARIANTS as there), output in /tmp/r/$G and archived to $OUT/$G.tgz. DEADLINE_S (default 500): after that many
# seconds the runs are stopped and what exists is archived to $OUT/$G-partial.tgz, so a call that runs long still
# brings back its finished runs. Run after benchmarks/results/issue5-session25/setup.sh.
set -u
g=${G:-a1}
deadline=${DEADLINE_S:-500}
mkdir -p /tmp/r/$g
setsid bash -c "source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1; NPROC=${NPROC:-1} CONFIG=${CONFIG:-A} COSTS=0 REPS=1 \
  ITERS=${ITERS:-60} RUN_TIMEOUT=${RUN_TIMEOUT:-150} VARIANTS='${VARIANTS:-baseline}' \
  bash benchmarks/gpu/issue5_host.sh /tmp/r/$g > /tmp/r/$g.txt 2>&1; grep -v '^  breakdown' /tmp/r/$g.txt | tail -40; \
  tar czf $OUT/$g.tgz -C /tmp/r $g $g.txt tree.txt" &
runs=$!
t0=$SECONDS
while kill -0 $runs 2>/dev/null && [ $((SECONDS - t0)) -lt "$deadline" ]; do sleep 2; done
if kill -0 $runs 2>/dev/null; then
  echo "deadline ${deadline}s reached: stopping the runs, archiving what exists"
  kill -- -$runs 2>/dev/null
  sleep 2
  tar czf $OUT/$g-partial.tgz -C /tmp/r $g $( [ -f /tmp/r/$g.txt ] && echo $g.txt ) tree.txt 2>/dev/null
fi
wait $runs 2>/dev/null
