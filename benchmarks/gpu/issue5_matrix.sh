#!/usr/bin/env bash
# Issue 5 after-measurements on one H100 (after staging, setup.sh 0.16.1 then 0.15.3, and patch apply):
#   bash benchmarks/gpu/issue5_matrix.sh OUTDIR A     # A: baseline/ours (core_attn, attention set, auto) + native
#   bash benchmarks/gpu/issue5_matrix.sh OUTDIR BC    # B and C: baseline/ours (the configurations' sets and auto)
#   bash benchmarks/gpu/issue5_matrix.sh OUTDIR B|C   # one of them
# Environment: REPEAT=3 runs each variant 3 times, interleaved (A and C are noisy); IMPLS="baseline ours" and
# SETS="core_attn auto" (names joined with '+') narrow the list; BUDGET=550 stops the sweep after that many
# seconds so that what finished still comes back within one device call.
set -u
out=${1:?outdir}; what=${2:?A|B|C|BC}; mkdir -p "$out"
pm() { timeout "${BUDGET:-100000}" python3 benchmarks/peak_memory.py --ours-megatron /root/mc-0.15.3 \
         --native-megatron /root/mc-0.16.1 --timeout 150 --repeat "${REPEAT:-1}" ${SETS:+--sets $SETS} "$@"; }
case $what in
  A) pm --config A --impls ${IMPLS:-baseline ours native} --out "$out/A" ;;
  B|C) pm --config "$what" --impls ${IMPLS:-baseline ours} --out "$out/$what" ;;
  BC) pm --config B --impls ${IMPLS:-baseline ours} --out "$out/B"; pm --config C --impls ${IMPLS:-baseline ours} --out "$out/C" ;;
esac
cd "$out" && tar czf "results-$what.tgz" ./* && find . -mindepth 1 -not -name "results-$what.tgz" -delete
