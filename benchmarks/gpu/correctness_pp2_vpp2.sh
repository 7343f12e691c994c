#!/usr/bin/env bash
# Issue 3 GPU acceptance at PP=2 x VPP=2 on two GPUs: loss bitwise equal to the no-offload run (deterministic
# kernels), every rank's peak lower. From the project root after `source .gpu/w/setup.sh 0.15.3`:
#   bash benchmarks/gpu/correctness_pp2_vpp2.sh OUTDIR [ITERS]
set -u
out=${1:?outdir}; iters=${2:-3}; mkdir -p "$out"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 PYTHONUNBUFFERED=1
python3 -m mcore_offload patch apply --megatron-path /root/mc-0.15.3 || exit 1
dense="--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192"
moe="--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 1024"
common="--deterministic --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 --seq-length 4096 --micro-batch-size 1 --num-microbatches 8 --bf16 --transformer-impl transformer_engine --train-iters $iters"
port=29700
nproc=2
source benchmarks/gpu/lib.sh
batch "dense '$dense' baseline" "dense '$dense' core_attn core_attn" \
      "dense '$dense' attn3 qkv_linear core_attn attn_proj"
batch "dense '$dense' all attn_norm qkv_linear core_attn attn_proj mlp_norm" "moe '$moe' baseline" \
      "moe '$moe' experts expert_fc1 moe_act"
batch "moe '$moe' all attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 moe_act"
python3 benchmarks/gpu/compare_runs.py "$out" | tee "$out/compare.txt"
