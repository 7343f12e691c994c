#!/usr/bin/env bash
# Issue 6 (and issue 5's CUDA paths) on the GPU host: the GPU-marked tests, their benchmark folders kept.
# After staging, `source .gpu/w/setup.sh 0.15.3` and patch apply:
#   [BUDGET=seconds] bash benchmarks/gpu/issue6_pytest.sh OUTDIR [pytest -k expression]
set -u
out=${1:?outdir}; mkdir -p "$out"
bash benchmarks/gpu/clear_build_locks.sh
# megatron-core 0.15.x compiles a unified-memory allocator at every import (inference/unified_memory.py); under CUDA 13
# the compile fails (cudaMemAdvise's new cudaMemLocation argument), so each Megatron process spent ~15 s on a failing
# build and could leave its lock behind. An extensions folder that cannot be made fails it at once, with the same
# warning and the same result (no unified memory; training never uses it). Our own C++ builds name their folder.
export TORCH_EXTENSIONS_DIR=/dev/null/no-torch-jit-extensions
# timeout signals its whole process group, so a test's import may die inside megatron's extension build: its lock
# would stall every later import (clear_build_locks.sh says why), hence the second clearing after the run; -v names
# each test as it ends, so a run that BUDGET stops still says which passed
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout --kill-after=10 "${BUDGET:-100000}" python3 -m pytest -v -m gpu tests/test_gpu.py -p no:cacheprovider -rfs --tb=short \
  --basetemp "$out/pt" ${2:+-k "$2"} 2>&1 | tee "$out/pytest.txt" | tail -30
sleep 2 && bash benchmarks/gpu/clear_build_locks.sh
cd "$out" && find pt -name "*.json" -o -name "*.md" -o -name "*.log" | tar czf results.tgz -T - pytest.txt
rm -rf pt
