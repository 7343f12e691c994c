#!/usr/bin/env bash
# Session 33: the storages each offload point copies, by size (benchmarks/gpu/census), for CONFIG's full set; every
# step offloaded, with --audit-offloaded (the Python flush reports each storage). Output: $OUT/census-$CONFIG.tgz.
# Run after benchmarks/results/issue5-session25/setup.sh.
set -u
cfg=${CONFIG:-C}
set_name=${SET:-all5}
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
export PYTHONPATH=$PWD/benchmarks/gpu/census:$PYTHONPATH MCO_CENSUS_OUT=/tmp/r/census-$cfg
mkdir -p /tmp/r/census-$cfg
NPROC=1 CONFIG=$cfg COSTS=0 REPS=1 ITERS=${ITERS:-8} RUN_TIMEOUT=${RUN_TIMEOUT:-200} VARIANTS="$set_name" \
  EXTRA="--audit-offloaded" bash benchmarks/gpu/issue5_host.sh /tmp/r/census-$cfg > /tmp/r/census-$cfg.txt 2>&1
tail -3 /tmp/r/census-$cfg.txt
python3 - /tmp/r/census-$cfg <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("census-rank*.json")):
    d = json.loads(f.read_text())
    calls = max(d["schedule_calls"], 1)
    print(f"{f.name}: {calls} schedule calls")
    for point, n, c in d["storages"]:
        print(f"  {point:12s} {n / 2**20:9.2f} MiB  x {c / calls:7.1f} a step")
PY
tar czf $OUT/census-$cfg.tgz -C /tmp/r census-$cfg census-$cfg.txt
