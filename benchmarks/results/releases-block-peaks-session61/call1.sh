#!/usr/bin/env bash
# Session 61, call 1 (one H200), after the four staging calls, carrying .gpu/w: the peaks of full recompute by block
# that session 60 had no device time for (block-recompute-session60/next.sh, part 1), against
# block-recompute-session60/NEXT-PREDICTIONS.md: A at 16 layers with a block of 4, A at 4 layers with a block of 2;
# baseline and ours in separate processes (peak_memory.py), core_attn and the attention set.
# Writes $OUT/setup.txt, tree.txt, gpu.txt, $OUT/blk16/ and $OUT/blk4/ (results.json, results.md, the runs' JSON).
#   bash benchmarks/results/releases-block-peaks-session61/call1.sh
set -u
out=${OUT:?}
bash benchmarks/results/issue5-session25/setup.sh > /dev/null 2>&1
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
cp /tmp/r/setup.txt /tmp/r/tree.txt "$out/"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$out/gpu.txt" 2>&1
rc="--recompute-granularity full --recompute-method block"
for spec in "blk16:16:4" "blk4:4:2"; do
  IFS=: read -r name layers n <<< "$spec"
  timeout 220 python3 benchmarks/peak_memory.py --config A --impls baseline ours --ours-megatron /root/mc-0.15.3 \
    --train-iters 10 --timeout 170 --out "$out/$name" --sets core_attn qkv_linear+core_attn+attn_proj \
    "--extra=--num-layers $layers $rc --recompute-num-layers $n" > "$out/$name.txt" 2>&1
  tail -6 "$out/$name/results.md" 2>/dev/null
done
