#!/usr/bin/env bash
# Session 61: the MoE selective-recompute GPU test, whose second set did not run in session 60 (C at 4 layers,
# `layernorm moe_act` recomputed; sets expert_fc1, then qkv_linear core_attn attn_proj expert_fc1). Carrying .gpu/w:
#   bash benchmarks/results/releases-block-peaks-session61/moe_recompute.sh
# Writes $OUT/pytest_moe_recompute.txt and $OUT/pt.tgz (the runs).
set -u
out=${OUT:?}
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout 370 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py \
  -rfs --tb=short -k "selective_recompute and moe" --basetemp "$out/pt" > "$out/pytest_moe_recompute.txt" 2>&1
grep -E "PASSED|FAILED|passed|failed" "$out/pytest_moe_recompute.txt" | tail -3
(cd "$out" && tar czf pt.tgz --exclude="*.png" pt && rm -rf pt)  # one file: the device tool returns few files
