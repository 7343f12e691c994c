#!/usr/bin/env bash
# Issue 5 after-measurements on one H100 (after staging, setup.sh 0.16.1 then 0.15.3, and patch apply):
#   bash benchmarks/gpu/issue5_matrix.sh OUTDIR A     # A: baseline/ours (core_attn, attention set, auto) + native
#   bash benchmarks/gpu/issue5_matrix.sh OUTDIR BC    # B and C: baseline/ours (the two sets and auto)
#   REPEAT=3 bash ...                                 # each variant 3 times, interleaved (A and C are noisy)
set -u
out=${1:?outdir}; what=${2:?A|BC}; mkdir -p "$out"
pm() { python3 benchmarks/peak_memory.py --ours-megatron /root/mc-0.15.3 --native-megatron /root/mc-0.16.1 \
         --timeout 150 --repeat "${REPEAT:-1}" "$@"; }
case $what in
  A) pm --config A --impls baseline ours native --out "$out/A" ;;
  BC) pm --config B --impls baseline ours --out "$out/B"; pm --config C --impls baseline ours --out "$out/C" ;;
esac
cd "$out" && tar czf "results-$what.tgz" ./* && find . -mindepth 1 -not -name "results-$what.tgz" -delete
