#!/usr/bin/env bash
# Session 56, third call: predict.py's batch 2 (predictions2.json committed before this ran). One GPU, after
# `source .gpu/w/setup.sh 0.15.3`. Writes OUTDIR/runs3.tgz.
#   bash benchmarks/results/planner-census-session56/run3.sh OUTDIR
set -u
out=${1:?outdir}; work=$(mktemp -d); here=benchmarks/results/planner-census-session56
port=29650
for name in E5-gqa-recompute-det E6-dense-mlp-recompute-det E7-moe-act-norm-recompute-det; do
  port=$((port + 1)); t0=$SECONDS
  # shellcheck disable=SC2046  # the flags are words
  timeout 200 torchrun --nproc-per-node 1 --master-port $port benchmarks/pretrain_gpt.py \
    $(python3 $here/predict.py flags $name) --json-out "$work/$name.json" > "$work/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s" | tee -a "$work/runs.txt"
done
python3 $here/predict.py compare "$work" 2 | tee "$work/compare.txt"
tar czf "$out/runs3.tgz" -C "$work" .
