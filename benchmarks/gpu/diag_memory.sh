#!/usr/bin/env bash
# Memory timeline of one dense config: baseline vs offload sets (diagnosis of peak behaviour).
set -u
out=${1:?outdir}; mkdir -p "$out"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 PYTHONUNBUFFERED=1
dense="--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --seq-length 4096 --micro-batch-size 1 --num-microbatches 2 --bf16 --train-iters 2 --deterministic --memory-timeline"
p=29600
for v in "baseline" "core_attn" "qkv_linear core_attn attn_proj"; do
  p=$((p+1)); name=$(echo $v | tr ' ' _)
  flags=""; [ "$v" != baseline ] && flags="--fine-grained-activation-offloading --offload-modules $v"
  (timeout 300 torchrun --nproc-per-node 1 --master-port $p benchmarks/pretrain_gpt.py $dense $flags --json-out $out/$name.json > $out/$name.log 2>&1; python3 -c "
import json; r=json.load(open('$out/$name.json'))['ranks'][0]; print('$name', r['peak_bytes']/2**20, r['memory_timeline_MiB'], r.get('offload',{}).get('last_step'))") &
done
wait
