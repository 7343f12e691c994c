#!/usr/bin/env bash
# Session 56, second call: the runs of predict.py (predictions.json committed before this ran). One GPU, after
# `source .gpu/w/setup.sh 0.15.3`. Writes OUTDIR/runs2.tgz (the device tool returns few files).
#   bash benchmarks/results/planner-census-session56/run2.sh OUTDIR
set -u
out=${1:?outdir}; work=$(mktemp -d); here=benchmarks/results/planner-census-session56
port=29630
for name in C-nondet E1-gqa-det E2-moe-mbs2-det E3-moe-mbs2-nondet E4-dense-recompute-det; do
  port=$((port + 1)); t0=$SECONDS
  # shellcheck disable=SC2046  # the flags are words
  timeout 200 torchrun --nproc-per-node 1 --master-port $port benchmarks/pretrain_gpt.py \
    $(python3 $here/predict.py flags $name) --json-out "$work/$name.json" > "$work/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s" | tee -a "$work/runs.txt"
done
python3 $here/predict.py compare "$work" | tee "$work/compare.txt"
tar czf "$out/runs2.tgz" -C "$work" .
