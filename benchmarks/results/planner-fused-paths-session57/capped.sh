#!/usr/bin/env bash
# Session 57, call 6: does P4's lower allocated peak hold when memory is short? Under a 4000 MiB cap the
# no-offload F4 (allocated peak 4098.5 MiB) should fail with an out-of-memory error and P4 (3826.5) should run,
# with its loss bitwise equal to F4's uncapped run (call 4), although uncapped it reserved 7670 MiB against F4's
# 4476 (its copies lag the forward: the allocator then takes new segments rather than wait). Writes OUTDIR/capped.tgz.
#   bash benchmarks/results/planner-fused-paths-session57/capped.sh OUTDIR
set -u
out=${1:?outdir}; work=$(mktemp -d); here=benchmarks/results/planner-fused-paths-session57
{ python3 -m mcore_offload patch apply --megatron-path /root/mc-0.15.3 && python3 -m mcore_offload build-native; } \
  > "$work/setup.txt" 2>&1 || { tail -5 "$work/setup.txt"; tar czf "$out/capped.tgz" -C "$work" .; exit 1; }
port=29770
for run in F4-local-det:4000 P4-local-dense5-det:4000 P4-local-dense5-det:3900; do
  name=${run%%:*}; cap=${run##*:}; port=$((port + 1)); t0=$SECONDS
  # shellcheck disable=SC2046  # the flags are words
  CAP_MIB=$cap MCORE_OFFLOAD_NATIVE=1 timeout 200 torchrun --nproc-per-node 1 --master-port $port \
    "$here/capped.py" $(python3 "$here/predict.py" flags "$name") --json-out "$work/$name-cap$cap.json" \
    > "$work/$name-cap$cap.log" 2>&1
  echo "$name cap $cap MiB rc=$? $((SECONDS - t0)) s $(grep -c 'OutOfMemoryError' "$work/$name-cap$cap.log") OOM lines" \
    | tee -a "$work/runs.txt"
done
python3 - "$work" <<'PY'
import json, os, sys
for f in sorted(os.listdir(sys.argv[1])):
    if f.endswith(".json"):
        r = json.load(open(os.path.join(sys.argv[1], f)))["ranks"][0]
        print(f, "peak", round(r["peak_bytes_step1"] / 2**20, 1), "reserved", round(r["allocator_state"]["reserved_bytes.all.current"] / 2**20),
              "syncs/step", r["allocator_per_step"]["num_sync_all_streams"], "step ms", [round(x, 1) for x in r["step_ms"]], "loss", r["loss_hex"])
PY
tar czf "$out/capped.tgz" -C "$work" .
