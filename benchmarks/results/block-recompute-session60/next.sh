#!/usr/bin/env bash
# For the next session with one GPU (written in session 60, not yet run): what session 60's calls had no device time
# for. After the four staging calls, carrying .gpu/w:
#   bash benchmarks/results/block-recompute-session60/next.sh
# Ran in session 61, split: releases-block-peaks-session61/call1.sh (part 1) and moe_recompute.sh (part 2).
# 1. the peaks of full recompute by block, against NEXT-PREDICTIONS.md (A at 16 layers, block of 4; A at 4 layers,
#    block of 2, whose JSON did not come back in call 1): peak_memory.py, baseline and ours in separate processes;
# 2. the MoE selective-recompute GPU test, whose second set did not run in session 60.
# Writes $OUT/blk16/, $OUT/blk4/ (results.json, results.md, the runs' JSON) and $OUT/pytest_moe_recompute.txt.
set -u
out=${OUT:?}
bash benchmarks/results/issue5-session25/setup.sh > /dev/null 2>&1
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
cp /tmp/r/tree.txt "$out/"
rc="--recompute-granularity full --recompute-method block"
for spec in "blk16:16:4" "blk4:4:2"; do
  IFS=: read -r name layers n <<< "$spec"
  timeout 200 python3 benchmarks/peak_memory.py --config A --impls baseline ours --ours-megatron /root/mc-0.15.3 \
    --train-iters 10 --timeout 150 --out "$out/$name" --sets core_attn qkv_linear+core_attn+attn_proj \
    "--extra=--num-layers $layers $rc --recompute-num-layers $n" > "$out/$name.txt" 2>&1
  tail -6 "$out/$name/results.md" 2>/dev/null
done
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout 240 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py \
  -rfs --tb=short -k "selective_recompute and moe" --basetemp /tmp/pt5 > "$out/pytest_moe_recompute.txt" 2>&1
grep -E "PASSED|FAILED|passed|failed" "$out/pytest_moe_recompute.txt" | tail -3
