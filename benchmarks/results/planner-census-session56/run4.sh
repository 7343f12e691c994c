#!/usr/bin/env bash
# Session 56, fourth call: predict_offload.py's runs (predictions3.json committed before this ran). One GPU, after
# `source .gpu/w/setup.sh 0.15.3`: patches /root/mc-0.15.3, builds the C++ hooks, runs. Writes OUTDIR/runs4.tgz.
#   bash benchmarks/results/planner-census-session56/run4.sh OUTDIR
set -u
out=${1:?outdir}; work=$(mktemp -d); here=benchmarks/results/planner-census-session56
{ python3 -m mcore_offload patch apply --megatron-path /root/mc-0.15.3 && python3 -m mcore_offload build-native; } \
  > "$work/setup.txt" 2>&1 || { tail -5 "$work/setup.txt"; tar czf "$out/runs4.tgz" -C "$work" .; exit 1; }
port=29670
for name in O1-gqa-attn-det O2-gqa-recompute-qkv-proj-det O3-moe-mbs2-experts-det O4-moe-recompute-fc1-det; do
  port=$((port + 1)); t0=$SECONDS
  # shellcheck disable=SC2046  # the flags are words
  MCORE_OFFLOAD_NATIVE=1 timeout 200 torchrun --nproc-per-node 1 --master-port $port benchmarks/pretrain_gpt.py \
    $(python3 $here/predict_offload.py flags $name) --json-out "$work/$name.json" > "$work/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s" | tee -a "$work/runs.txt"
done
python3 $here/predict_offload.py compare "$work" 3 | tee "$work/compare.txt"
tar czf "$out/runs4.tgz" -C "$work" .
