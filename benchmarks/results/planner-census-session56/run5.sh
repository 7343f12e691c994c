#!/usr/bin/env bash
# Session 56, fifth call: dropout. predict.py's batch 4 (no offloading) and predict_offload.py's batch 5
# (predictions4.json and predictions5.json committed before this ran). One GPU, after
# `source .gpu/w/setup.sh 0.15.3`: patches /root/mc-0.15.3, builds the C++ hooks, runs. Writes OUTDIR/runs5.tgz.
#   bash benchmarks/results/planner-census-session56/run5.sh OUTDIR
set -u
out=${1:?outdir}; work=$(mktemp -d); here=benchmarks/results/planner-census-session56
{ python3 -m mcore_offload patch apply --megatron-path /root/mc-0.15.3 && python3 -m mcore_offload build-native; } \
  > "$work/setup.txt" 2>&1 || { tail -5 "$work/setup.txt"; tar czf "$out/runs5.tgz" -C "$work" .; exit 1; }
port=29690
run() {  # name, script
  port=$((port + 1)); local t0=$SECONDS
  # shellcheck disable=SC2046  # the flags are words
  MCORE_OFFLOAD_NATIVE=1 timeout 200 torchrun --nproc-per-node 1 --master-port $port benchmarks/pretrain_gpt.py \
    $(python3 "$here/$2" flags "$1") --json-out "$work/$1.json" > "$work/$1.log" 2>&1
  echo "$1 rc=$? $((SECONDS - t0)) s" | tee -a "$work/runs.txt"
}
run E8-dense-dropout-det predict.py
run O5-dense-dropout-attn-det predict_offload.py
run E9-dense-dropouts-det predict.py
mkdir -p "$here/runs5" && cp "$work/E8-dense-dropout-det.json" "$here/runs5/"  # O5's no-offload twin
{ python3 $here/predict.py compare "$work" 4; python3 $here/predict_offload.py compare "$work" 5; } \
  | tee "$work/compare.txt"
tar czf "$out/runs5.tgz" -C "$work" .
