#!/usr/bin/env bash
# Issue 5, first diagnosis on the GPU host (after staging, setup.sh 0.15.3 and patch apply):
#   bash benchmarks/gpu/issue5_diag.sh OUTDIR
# A (baseline, core_attn, attention set) with automatic GC and with --manual-gc, then B (attention set),
# each row with the runtime's telemetry: stall ms, D2H/H2D GB/s, host time in the hooks, GC time.
set -u
out=${1:?outdir}; mkdir -p "$out"
pm() { python3 benchmarks/peak_memory.py --impls baseline ours --ours-megatron /root/mc-0.15.3 --timeout 200 "$@"; }
pm --config A --out "$out/A"
pm --config A --extra=--manual-gc --out "$out/A-manual-gc"   # (--extra "--manual-gc" was read as an option: that run failed)
pm --config B --out "$out/B"
cd "$out" && tar czf results.tgz A A-manual-gc B && rm -rf A A-manual-gc B
