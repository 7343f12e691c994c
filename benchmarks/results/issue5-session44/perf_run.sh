#!/usr/bin/env bash
# Session 44: D-dense variants under perf record (every thread of both ranks, 1 ms of CPU a sample, call chains,
# CLOCK_MONOTONIC), then each run's samples split into offloaded and plain steps by benchmarks/perf_steps.py.
# Needs the perf bundle (benchmarks/gpu/perf_bundle.sh) unpacked at $PERF_DIR (default /root/perfb/perf) and
# benchmarks/results/issue5-session25/setup.sh run before. G, VARIANTS, ITERS, RUN_TIMEOUT, DEADLINE_S as in
# issue5-session30/run_cfg.sh; the summaries go to $OUT/$G-<variant>.perf.txt and .perf.json.
set -u
g=${G:-pf1}
perf_dir=${PERF_DIR:-/root/perfb/perf}
mkdir -p /tmp/perf
export PYTHONPERFSUPPORT=1  # Python 3.12: Python functions in the call chains as py::NAME:FILE
LAUNCH_PREFIX="bash $perf_dir/record.sh /tmp/perf/$g-@TAG@.perf.data" NPROC=${NPROC:-2} CONFIG=${CONFIG:-D-dense} \
  bash benchmarks/results/issue5-session30/run_cfg.sh
for data in /tmp/perf/$g-*.perf.data; do
  [ -e "$data" ] || continue
  tag=$(basename "$data" .perf.data); tag=${tag#$g-}
  run=/tmp/r/$g/$tag.json
  [ -s "$run" ] || { echo "no JSON for $tag"; continue; }
  t0=$SECONDS
  # --max-stack 24: without a limit perf script did not finish one D-dense run's samples in five minutes (call 10)
  timeout "${SCRIPT_TIMEOUT:-250}" bash "$perf_dir/perf.sh" script --max-stack 24 -i "$data" -F comm,pid,tid,time,ip,sym,dso 2> "$OUT/$g-$tag.perf-script.err" | \
    python3 benchmarks/perf_steps.py "$run" --period-ns "${PERF_PERIOD_NS:-1000000}" --top 40 \
      --json-out "$OUT/$g-$tag.perf.json" > "$OUT/$g-$tag.perf.txt" 2>&1
  echo "$tag: perf script and perf_steps.py took $((SECONDS - t0)) s ($(du -h "$data" | cut -f1) of samples)"
  head -30 "$OUT/$g-$tag.perf.txt"
done
