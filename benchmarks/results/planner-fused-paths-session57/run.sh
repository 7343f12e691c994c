#!/usr/bin/env bash
# Session 57: runs of predict.py (predictions.json committed before any of them ran), one GPU, after
# `source .gpu/w/setup.sh 0.15.3`: patches /root/mc-0.15.3 (idempotent), builds the C++ hooks, runs the named
# runs in order, compares what has run, and writes OUTDIR/TAG.tgz.
#   bash benchmarks/results/planner-fused-paths-session57/run.sh OUTDIR TAG NAME...
set -u
out=${1:?outdir}; tag=${2:?tag}; shift 2
work=$(mktemp -d); here=benchmarks/results/planner-fused-paths-session57
{ python3 -m mcore_offload patch apply --megatron-path /root/mc-0.15.3 && python3 -m mcore_offload build-native; } \
  > "$work/setup.txt" 2>&1 || { tail -5 "$work/setup.txt"; tar czf "$out/$tag.tgz" -C "$work" .; exit 1; }
port=29710
for name in "$@"; do
  port=$((port + 1)); t0=$SECONDS
  # shellcheck disable=SC2046  # the flags are words
  MCORE_OFFLOAD_NATIVE=1 timeout 200 torchrun --nproc-per-node 1 --master-port $port benchmarks/pretrain_gpt.py \
    $(python3 "$here/predict.py" flags "$name") --json-out "$work/$name.json" > "$work/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s" | tee -a "$work/runs.txt"
done
python3 "$here/predict.py" compare "$work" | tee "$work/compare.txt"
tar czf "$out/$tag.tgz" -C "$work" .
