#!/usr/bin/env bash
# Session 25, device call 1 (after the four staging calls): install, patch, build, GPU tests, runtime breakdown.
set -u
mkdir -p /tmp/r
source .gpu/w/setup.sh 0.16.1 > /tmp/r/setup.txt 2>&1
source .gpu/w/setup.sh 0.15.3 >> /tmp/r/setup.txt 2>&1
python3 -m mcore_offload patch apply --megatron-path /root/mc-0.15.3 >> /tmp/r/setup.txt 2>&1
python3 -m mcore_offload build-native >> /tmp/r/setup.txt 2>&1
{ git rev-parse HEAD 2>/dev/null || echo no-git; sha1sum mcore_offload/runtime/*.py mcore_offload/runtime/native/*; } > /tmp/r/tree.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /tmp/r/gpus.txt 2>&1
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  -k "bitwise or forward_only or fault" > /tmp/r/pytest.txt 2>&1; echo "pytest rc $?" >> /tmp/r/pytest.txt
tail -3 /tmp/r/pytest.txt
NPROC=2 CONFIG=D-dense COSTS=0 REPS=1 ITERS=30 RUN_TIMEOUT=120 VARIANTS="core_attn_bd" \
  bash benchmarks/gpu/issue5_host.sh /tmp/r/bd > /tmp/r/bd.txt 2>&1
tail -40 /tmp/r/bd.txt
rm -f /tmp/r/*/host_topology.txt
tar czf $OUT/r1.tgz -C /tmp/r .
