#!/usr/bin/env bash
# Issue 5, configuration D (2 GPUs): ours and native in one command, with the allocator trace of the peak step
# (--peak-trace), plus ours under the runtime switches that move copies around the peak. After staging:
#   source .gpu/w/setup.sh 0.16.1; source .gpu/w/setup.sh 0.15.3; python3 -m mcore_offload patch apply ...
#   bash benchmarks/gpu/issue5_d_peak.sh OUT dense|moe
# VARIANTS: "NAME:ENV=VALUE[,ENV=VALUE]" runs of ours on the full set, each its own folder under OUT.
set -u
out=${1:?OUT}; which=${2:?dense or moe}
iters=${ITERS:-20}; per_run=${RUN_TIMEOUT:-150}
if [ "$which" = dense ]; then
  cfg=D-dense; sets=${SETS:-"core_attn qkv_linear+core_attn+attn_proj"}; full=qkv_linear+core_attn+attn_proj
else
  cfg=D-moe; sets=${SETS:-"qkv_linear+core_attn+attn_proj+expert_fc1+moe_act"}
  full=qkv_linear+core_attn+attn_proj+expert_fc1+moe_act
fi
common=(--config "$cfg" --train-iters "$iters" --warmup-steps 4 --timeout "$per_run" --extra=--peak-trace)
# shellcheck disable=SC2086
python3 benchmarks/peak_memory.py "${common[@]}" --impls baseline ours native --native-megatron /root/mc-0.16.1 \
  --ours-megatron /root/mc-0.15.3 --sets $sets --out "$out/$cfg" 2>&1 | grep -v "^|"
for v in ${VARIANTS:-}; do
  name=${v%%:*}; envs=${v#*:}
  (export ${envs//,/ }; python3 benchmarks/peak_memory.py "${common[@]}" --impls ours --ours-megatron /root/mc-0.15.3 \
    --sets "$full" --out "$out/$cfg-$name" 2>&1 | grep -v "^|")
done
python3 - "$out" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*/*.json")):
    if f.endswith("results.json"):
        continue
    d = json.load(open(f))
    for r in d["ranks"]:
        t = r.get("peak_trace") or {}
        print(f.split("/")[-2], r["label"].split("__", 1)[1], "rank", r["rank"], "peak MiB", r["peak_bytes"] >> 20,
              "step ms", round(r["step_ms_median"], 1), "reload live MiB",
              {k: v >> 20 for k, v in (t.get("live_reload_bytes") or {}).items()}, "at", (t.get("peak_alloc_where") or [])[:4])
PY
