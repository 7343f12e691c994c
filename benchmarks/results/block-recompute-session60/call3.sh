#!/usr/bin/env bash
# Session 60, call 3 (one H200, after re-staging): the TE-path GPU tests that call 1's 300 s limit cut off after
# the dense selective-recompute test: selective recompute (MoE) and FP8 delayed scaling (dense, MoE), verbose, so
# that a cut run still says which passed. Writes $OUT/pytest_te2.txt and $OUT/te2.tgz.
#   bash benchmarks/results/block-recompute-session60/call3.sh
set -u
out=${OUT:?}
bash benchmarks/results/issue5-session25/setup.sh > /dev/null 2>&1
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
cp /tmp/r/tree.txt "$out/tree3.txt"
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout 450 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py \
  -rfs --tb=short -k "(selective_recompute and moe) or fp8" --basetemp /tmp/pt3 > "$out/pytest_te2.txt" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/pytest_te2.txt" | tail -6
(cd /tmp && find pt3 -name "*.json" -o -name "*.md" 2>/dev/null | tar czf "$out/te2.tgz" -T -)
