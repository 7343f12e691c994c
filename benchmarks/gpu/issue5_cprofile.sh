#!/usr/bin/env bash
# Issue 5: where config A's host time goes. cProfile of steps 4-5 (autograd on the main thread) for the
# baseline, core_attn and the attention set, then A with --manual-gc. GPU host, after setup.sh and patch apply:
#   bash benchmarks/gpu/issue5_cprofile.sh OUTDIR
set -u
out=${1:?outdir}; mkdir -p "$out"
A="--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --seq-length 4096
   --micro-batch-size 1 --bf16 --transformer-impl transformer_engine --deterministic --num-microbatches 4"
run() {
  name=$1; shift
  timeout 240 python3 -m torch.distributed.run --nproc-per-node 1 benchmarks/pretrain_gpt.py $A --train-iters 6 \
    --cprofile-steps 4 5 --profile-dir "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo "$name rc=$?"
}
run base
run core --fine-grained-activation-offloading --offload-modules core_attn
run attn --fine-grained-activation-offloading --offload-modules qkv_linear core_attn attn_proj
python3 benchmarks/peak_memory.py --impls baseline ours --ours-megatron /root/mc-0.15.3 --timeout 200 --config A \
  --extra=--manual-gc --out "$out/Agc" > "$out/Agc.log" 2>&1
cd "$out" && tar czf results.tgz ./* && find . -mindepth 1 -not -name results.tgz -delete
