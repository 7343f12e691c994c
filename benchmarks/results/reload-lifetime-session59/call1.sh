#!/usr/bin/env bash
# Session 59, call 1 (one H200), after the four staging calls: the GPU tests of the CUDA paths (with the new test of
# reloaded storages' lifetime, test_cuda_reloaded_storages_go_with_their_last_reader), then session 58's local-spec
# runs F4, P4 and P4 with the copy-out bound (bound.sh) on the runtime that lets a reloaded storage go with its last
# reader. Writes $OUT/pytest_gpu.txt, setup.txt, tree.txt and $OUT/call1.tgz.
#   bash benchmarks/results/reload-lifetime-session59/call1.sh
set -u
out=${OUT:?}
bash benchmarks/results/issue5-session25/setup.sh > /dev/null 2>&1
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
cp /tmp/r/setup.txt /tmp/r/tree.txt "$out/"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  -k "cuda_ or fault or forward_only or deterministic" > "$out/pytest_gpu.txt" 2>&1
tail -3 "$out/pytest_gpu.txt"
bash benchmarks/results/d2h-in-flight-session58/bound.sh "$out" call1 F4:F4-local-det:0:2:0 \
  P4-ifl0:P4-local-dense5-det:0:2:0 P4-ifl1:P4-local-dense5-det:1:2:0
