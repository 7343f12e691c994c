#!/usr/bin/env bash
# Profile two steps of config A (baseline, ours core_attn, ours attention set) and summarise where the time
# goes (benchmarks/trace_analysis.py). GPU host, project root, megatron 0.15.3 patched:
#   bash benchmarks/gpu/profile_A.sh OUTDIR
set -u
out=${1:?outdir}; mkdir -p "$out"
A="--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --seq-length 4096
   --micro-batch-size 1 --bf16 --transformer-impl transformer_engine --deterministic --num-microbatches 4
   --train-iters 6 --profile-steps 4 5"
for v in "baseline" "core_attn core_attn" "attn qkv_linear core_attn attn_proj"; do
  set -- $v; name=$1; shift
  flags=""; [ $# -gt 0 ] && flags="--fine-grained-activation-offloading --offload-modules $*"
  timeout 200 torchrun --nproc-per-node 1 --master-port 29510 benchmarks/pretrain_gpt.py $A $flags \
    --profile-dir "$out/$name" --json-out "$out/$name/run.json" > "$out/$name.log" 2>&1 || echo "FAILED $name"
  grep "profile:" "$out/$name.log"
done
