#!/usr/bin/env bash
# Profile two steps of configuration D (PP=2 x VPP=2, one rank per GPU) under torch.profiler and summarise where the
# time goes on each rank (benchmarks/trace_analysis.py: compute stream busy, idle waiting on the host, idle waiting on
# the GPU). GPU host with 2 GPUs, project root, megatron 0.15.3 patched:
#   [CONFIG=D-dense|D-moe] [VARIANTS="baseline core_attn attn"] bash benchmarks/gpu/profile_D.sh OUTDIR
# Variants: baseline; core_attn; attn (qkv_linear core_attn attn_proj); experts (expert_fc1 moe_act); all5.
set -u
out=${1:?outdir}; mkdir -p "$out"
config=${CONFIG:-D-dense}
model=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import peak_memory as p; c = p.CONFIGS['$config']
print(c.model, c.extra)") || exit 1
i=0
for name in ${VARIANTS:-baseline core_attn attn}; do
  case $name in baseline) mods="" ;; core_attn) mods="core_attn" ;; attn) mods="qkv_linear core_attn attn_proj" ;;
    experts) mods="expert_fc1 moe_act" ;; all5) mods="qkv_linear core_attn attn_proj expert_fc1 moe_act" ;;
    *) echo "unknown variant $name"; exit 1 ;; esac
  flags=""; [ -n "$mods" ] && flags="--fine-grained-activation-offloading --offload-modules $mods"
  i=$((i + 1))
  timeout ${RUN_TIMEOUT:-150} torchrun --nproc-per-node 2 --master-port $((29540 + i)) benchmarks/pretrain_gpt.py \
    $model --train-iters 8 --profile-steps 6 7 $flags --profile-dir "$out/$name" --json-out "$out/$name/run.json" \
    > "$out/$name.log" 2>&1 || echo "FAILED $name"
  grep "profile:" "$out/$name.log"
done
