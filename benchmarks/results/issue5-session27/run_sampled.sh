#!/usr/bin/env bash
# Session 27: D-dense runs as session 25's run3.sh makes them (ITERS settable), with the host and the GPUs sampled beside them, to tell what the host's slow
# periods are (hypervisor steal, other load, GPU clocks). G names the output folder; the samplers write into it.
# DEADLINE_S (default 400): after that many seconds the runs are stopped and whatever exists is archived to
# $OUT/G-partial.tgz, so a call that runs long still brings back its finished runs (session 27's first try of this
# script ran past the device call's limit and brought back nothing). Set it at least 30 s under the call's limit.
set -u
g=${G:-s1}
deadline=${DEADLINE_S:-400}
mkdir -p /tmp/r/$g
fields=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
# once a second: NVML queries take a driver lock, and sampling much faster might itself disturb the runs
nvidia-smi --query-gpu=$fields,clocks_event_reasons.active --format=csv -l 1 > /tmp/r/$g/smi.csv 2>&1 &
smi=$!
sleep 1
if ! kill -0 $smi 2>/dev/null; then  # an older driver without clocks_event_reasons
  nvidia-smi --query-gpu=$fields --format=csv -l 1 > /tmp/r/$g/smi.csv 2>&1 &
  smi=$!
fi
vmstat -t 1 > /tmp/r/$g/vmstat.txt 2>&1 &
vm=$!
# session 25's run3.sh, with ITERS settable (block-alternating runs want more steps than its 60)
setsid bash -c "source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1; NPROC=2 CONFIG=D-dense COSTS=0 REPS=${REPS:-1} \
  ITERS=${ITERS:-60} RUN_TIMEOUT=${RUN_TIMEOUT:-150} VARIANTS='${VARIANTS:-baseline}' \
  bash benchmarks/gpu/issue5_host.sh /tmp/r/$g > /tmp/r/$g.txt 2>&1; grep -v '^  breakdown' /tmp/r/$g.txt | tail -40; \
  rm -f /tmp/r/*/host_topology.txt; tar czf $OUT/$g.tgz -C /tmp/r $g $g.txt tree.txt" &
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
kill $smi $vm 2>/dev/null
tar czf $OUT/$g-samplers.tgz -C /tmp/r $g/smi.csv $g/vmstat.txt
