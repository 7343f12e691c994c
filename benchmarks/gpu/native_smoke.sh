#!/usr/bin/env bash
# A tiny run of pretrain_gpt.py on upstream megatron-core 0.16.1 with its native offloading, and the same
# on 0.15.3 + mcore-offload: a broken setup should cost seconds, not a whole matrix. GPU host, project root,
# after `source .gpu/w/setup.sh 0.16.1; source .gpu/w/setup.sh 0.15.3` (both trees installed).
set -u
out=${1:?outdir}; mkdir -p "$out"
tiny="--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 --num-experts 4 --moe-router-topk 2
  --moe-ffn-hidden-size 512 --bf16 --train-iters 3 --num-microbatches 2 --deterministic --fine-grained-activation-offloading
  --offload-modules qkv_linear core_attn attn_proj expert_fc1 moe_act"
for tree in /root/mc-0.16.1 /root/mc-0.15.3; do
  PYTHONPATH=$tree:$PYTHONPATH timeout 240 torchrun --nproc-per-node 1 --master-port 29498 benchmarks/pretrain_gpt.py \
    $tiny --json-out "$out/smoke-$(basename $tree).json" > "$out/smoke-$(basename $tree).log" 2>&1 \
    && echo "smoke ok: $tree" || { echo "SMOKE FAILED: $tree"; grep -v -i warn "$out/smoke-$(basename $tree).log" | tail -40; }
done
