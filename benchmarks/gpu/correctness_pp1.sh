#!/usr/bin/env bash
# Issue 3 GPU acceptance at PP=1 (one GPU): every offload point alone and all together, dense and MoE,
# TE spec, bf16, deterministic kernels; loss must be bitwise equal to the no-offload run, peak lower.
# Runs on the GPU host from the project root after `source .gpu/w/setup.sh 0.15.3`:
#   bash benchmarks/gpu/correctness_pp1.sh OUTDIR [ITERS]
set -u
out=${1:?outdir}; iters=${2:-3}; mkdir -p "$out"
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 PYTHONUNBUFFERED=1
if command -v git >/dev/null; then python3 -m mcore_offload patch apply --megatron-path /root/mc-0.15.3 || exit 1
else echo "no git on this host: copying files patched by mcore-offload patch apply elsewhere"; cp -r .gpu/patched/megatron /root/mc-0.15.3/; fi
python3 -c "import mcore_offload; mcore_offload.ensure_patched(); print(\"patched ok\")" || exit 1
dense="--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192"
moe="--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 1024"
common="--deterministic --seq-length 4096 --micro-batch-size 1 --num-microbatches 2 --bf16 --transformer-impl transformer_engine --train-iters $iters --min-offloaded-tensor-size 1048576"
port=29500
[ "${SMOKE:-1}" = 0 ] || {
# Smoke first (tiny MoE, every point): a broken build should cost seconds, not the whole matrix.
timeout 240 torchrun --nproc-per-node 1 --master-port 29499 benchmarks/pretrain_gpt.py --num-layers 4 \
  --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 --num-experts 4 --moe-router-topk 2 \
  --moe-ffn-hidden-size 512 --bf16 --train-iters 2 --num-microbatches 2 --fine-grained-activation-offloading \
  --offload-modules attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 moe_act \
  > "$out/smoke.log" 2>&1 || { echo "SMOKE FAILED"; grep -v -i warn "$out/smoke.log" | tail -60; exit 1; }
grep -A12 "mcore-offload summary" "$out/smoke.log" | head -14
}
nproc=1
source benchmarks/gpu/lib.sh
batch "dense '$dense' baseline" "moe '$moe' baseline" \
      "dense '$dense' all attn_norm qkv_linear core_attn attn_proj mlp_norm" \
      "moe '$moe' all attn_norm qkv_linear core_attn attn_proj mlp_norm expert_fc1 moe_act"
batch "dense '$dense' attn_norm attn_norm" "dense '$dense' qkv_linear qkv_linear" \
      "dense '$dense' core_attn core_attn" "dense '$dense' attn_proj core_attn attn_proj"
batch "dense '$dense' mlp_norm mlp_norm" "moe '$moe' expert_fc1 expert_fc1" \
      "moe '$moe' moe_act moe_act" "moe '$moe' core_attn core_attn"
batch "moe '$moe' qkv_linear qkv_linear" "moe '$moe' attn_proj core_attn attn_proj" \
      "moe '$moe' attn_norm attn_norm" "moe '$moe' mlp_norm mlp_norm"
python3 benchmarks/gpu/compare_runs.py "$out" | tee "$out/compare.txt"
