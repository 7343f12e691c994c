#!/usr/bin/env bash
# Issue 6 (and issue 5's CUDA paths) on the GPU host: the GPU-marked tests, their benchmark folders kept.
# After staging, `source .gpu/w/setup.sh 0.15.3` and patch apply:
#   [BUDGET=seconds] bash benchmarks/gpu/issue6_pytest.sh OUTDIR [pytest -k expression]
set -u
out=${1:?outdir}; mkdir -p "$out"
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout "${BUDGET:-100000}" python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -rfs --tb=short \
  --basetemp "$out/pt" ${2:+-k "$2"} 2>&1 | tee "$out/pytest.txt" | tail -30
cd "$out" && find pt -name "*.json" -o -name "*.md" -o -name "*.log" | tar czf results.tgz -T - pytest.txt
rm -rf pt
