#!/usr/bin/env bash
# For the next session with a GPU (written in session 61, not yet run): `mcore-offload measure` (added in session 61
# after the device time was spent) on the host, its GPU test, and a plan from the measured file next to the h200
# preset. After the four staging calls, carrying .gpu/w:
#   bash benchmarks/results/releases-block-peaks-session61/next.sh
# Writes $OUT/setup.txt, tree.txt, hw.json (twice: default sizes, then 1 GiB copies), measure.txt, plan_*.txt and
# pytest_measure.txt.
set -u
out=${OUT:?}
bash benchmarks/results/issue5-session25/setup.sh > /dev/null 2>&1
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
cp /tmp/r/setup.txt /tmp/r/tree.txt "$out/"
{ python3 -m mcore_offload measure --json-out "$out/hw.json"
  python3 -m mcore_offload measure --copy-mib 1024 --iters 10 --json-out "$out/hw_1g.json"; } > "$out/measure.txt" 2>&1
cat "$out/measure.txt"
plan="plan --preset llama3-8b --seq-length 8192 --pipeline-model-parallel-size 2 --num-microbatches 8"
python3 -m mcore_offload $plan --gpu h200 > "$out/plan_h200_preset.txt" 2>&1
python3 -m mcore_offload $plan --hardware-json "$out/hw.json" > "$out/plan_measured.txt" 2>&1
tail -4 "$out/plan_measured.txt"
timeout 120 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py -rfs --tb=short -k measure \
  > "$out/pytest_measure.txt" 2>&1
grep -E "PASSED|FAILED|passed|failed" "$out/pytest_measure.txt" | tail -2
