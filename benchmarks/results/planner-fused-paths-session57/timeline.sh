#!/usr/bin/env bash
# Session 57, call 5: where the local spec's offloaded peak sits (P4 moved 5.3 GiB a step yet lowered the peak by
# 272 MiB, with no byte off the device at the peak). F4 and P4 again with --memory-timeline (allocated memory at
# each microbatch's forward start and end and backward start). Writes OUTDIR/timeline.tgz.
#   bash benchmarks/results/planner-fused-paths-session57/timeline.sh OUTDIR
set -u
out=${1:?outdir}; work=$(mktemp -d); here=benchmarks/results/planner-fused-paths-session57
{ python3 -m mcore_offload patch apply --megatron-path /root/mc-0.15.3 && python3 -m mcore_offload build-native; } \
  > "$work/setup.txt" 2>&1 || { tail -5 "$work/setup.txt"; tar czf "$out/timeline.tgz" -C "$work" .; exit 1; }
port=29750
for name in F4-local-det P4-local-dense5-det; do
  port=$((port + 1)); t0=$SECONDS
  # shellcheck disable=SC2046  # the flags are words
  MCORE_OFFLOAD_NATIVE=1 timeout 200 torchrun --nproc-per-node 1 --master-port $port benchmarks/pretrain_gpt.py \
    $(python3 "$here/predict.py" flags "$name") --memory-timeline --json-out "$work/$name-timeline.json" \
    > "$work/$name-timeline.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s" | tee -a "$work/runs.txt"
done
python3 - "$work" <<'PY'
import json, sys
for name in ("F4-local-det", "P4-local-dense5-det"):
    row = json.load(open(f"{sys.argv[1]}/{name}-timeline.json"))["ranks"][0]
    print(name, "peak step 1", round(row["peak_bytes_step1"] / 2**20, 1), "MiB")
    print("  ", row["memory_timeline_MiB"][12:24])
PY
tar czf "$out/timeline.tgz" -C "$work" .
