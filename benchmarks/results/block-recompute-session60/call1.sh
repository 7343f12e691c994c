#!/usr/bin/env bash
# Session 60, call 1 (one H200), after the four staging calls: the GPU tests of the CUDA paths on the current
# runtime (session 59's last three commits had not run on the GPU), the new test of full recompute by block
# (test_block_full_recompute_of_the_first_layers_equal_loss_and_the_planners_bytes), then the TE paths most exposed
# to the reload-lifetime changes: selective recompute (dense and MoE) and FP8 (dense and MoE).
# Writes $OUT/pytest_gpu.txt, pytest_te.txt, setup.txt, tree.txt, gpu.txt and $OUT/te.tgz (the runs' results).
#   bash benchmarks/results/block-recompute-session60/call1.sh
set -u
out=${OUT:?}
bash benchmarks/results/issue5-session25/setup.sh > /dev/null 2>&1
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
cp /tmp/r/setup.txt /tmp/r/tree.txt "$out/"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  -rfs --tb=short -k "cuda_ or fault or forward_only or deterministic or block_full_recompute" \
  --basetemp /tmp/pt1 > "$out/pytest_gpu.txt" 2>&1
tail -3 "$out/pytest_gpu.txt"
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  -rfs --tb=short -k "selective_recompute or fp8" --basetemp /tmp/pt2 > "$out/pytest_te.txt" 2>&1
tail -3 "$out/pytest_te.txt"
(cd /tmp && find pt1 pt2 -name "*.json" -o -name "*.md" 2>/dev/null | tar czf "$out/te.tgz" -T -)
