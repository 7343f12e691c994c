#!/usr/bin/env bash
# Session 58: the local-spec runs of session 57 (F4, and P4 = F4 with all five dense points, whose copies cannot keep
# up with the forward) with the copy-out bound MCORE_OFFLOAD_D2H_IN_FLIGHT, one GPU, after
# `source .gpu/w/setup.sh 0.15.3`. Patches /root/mc-0.15.3 (idempotent), builds the C++ hooks, runs each spec in
# order and writes OUTDIR/TAG.tgz with the JSONs, gzipped logs and summary.txt.
#   bash benchmarks/results/d2h-in-flight-session58/bound.sh OUTDIR TAG LABEL:NAME:IN_FLIGHT:FLUSH_LAYERS:CAP_MIB ...
# NAME: a run of ../planner-fused-paths-session57/predict.py; CAP_MIB 0: no cap, else capped.py's device-memory cap.
set -u
out=${1:?outdir}; tag=${2:?tag}; shift 2
work=$(mktemp -d); here=benchmarks/results/d2h-in-flight-session58; s57=benchmarks/results/planner-fused-paths-session57
{ python3 -m mcore_offload patch apply --megatron-path /root/mc-0.15.3 && python3 -m mcore_offload build-native; } \
  > "$work/setup.txt" 2>&1 || { tail -5 "$work/setup.txt"; tar czf "$out/$tag.tgz" -C "$work" .; exit 1; }
port=29810
for spec in "$@"; do
  IFS=: read -r label name ifl flush cap <<< "$spec"
  port=$((port + 1)); t0=$SECONDS
  script=benchmarks/pretrain_gpt.py; [ "$cap" != 0 ] && script=$s57/capped.py
  # shellcheck disable=SC2046  # the flags are words
  CAP_MIB=$cap MCORE_OFFLOAD_D2H_IN_FLIGHT=$ifl MCORE_OFFLOAD_FLUSH_LAYERS=$flush MCORE_OFFLOAD_NATIVE=1 \
    timeout 200 torchrun --nproc-per-node 1 --master-port $port $script \
    $(python3 "$s57/predict.py" flags "$name") --train-iters 8 --warmup-steps 2 --json-out "$work/$label.json" \
    > "$work/$label.log" 2>&1
  echo "$label ($spec) rc=$? $((SECONDS - t0)) s, $(grep -c 'OutOfMemoryError' "$work/$label.log") OOM lines" \
    | tee -a "$work/runs.txt"
done
python3 "$here/summarize.py" "$work" | tee "$work/summary.txt"
gzip -f "$work"/*.log
tar czf "$out/$tag.tgz" -C "$work" .
