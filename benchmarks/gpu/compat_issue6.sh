#!/usr/bin/env bash
# Issue 6 on the GPU host: each combination measured as baseline vs ours with peak_memory.py (loss equality per
# run, per-rank peaks, after-step allocated memory against the baseline, pinned allocations per step).
# Prepared, not yet run. GPU host, project root, after `source .gpu/w/setup.sh 0.15.3` and patch apply:
#   bash benchmarks/gpu/compat_issue6.sh OUTDIR {1gpu|2gpu|4gpu}
set -u
out=${1:?outdir}; what=${2:?1gpu|2gpu|4gpu}; mkdir -p "$out"
pm() { python3 benchmarks/peak_memory.py --impls baseline ours --ours-megatron /root/mc-0.15.3 --timeout 300 "$@"; }
case $what in
  1gpu)
    pm --config A --extra "--fp8 hybrid" --out "$out/fp8"                       # FP8 delayed scaling (H100)
    pm --config A --extra "--attention-backend flash" --out "$out/flash"
    pm --config A --extra "--attention-backend fused" --out "$out/fused"
    pm --config A --extra "--eval-interval 2 --eval-iters 2" --out "$out/eval"
    pm --config A --train-iters 200 --out "$out/200steps" ;;                    # after-step memory, pinned flat
  2gpu)
    pm --config E-tp2sp --out "$out/tp2sp"
    pm --config E-ep2 --out "$out/ep2"
    pm --config E-pp2 --out "$out/pp2" ;;                                        # plain 1F1B
  4gpu)
    pm --config E-pp2vpp2tp2 --out "$out/pp2vpp2tp2" ;;
esac
for d in "$out"/*/; do tar czf "${d%/}.tgz" -C "$out" "$(basename "$d")"; done
