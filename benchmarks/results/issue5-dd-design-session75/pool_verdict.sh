#!/usr/bin/env bash
# The design's one verdict (DESIGN.md "How it is read"), on the development machine once de16 has run:
#   bash benchmarks/results/issue5-dd-design-session75/pool_verdict.sh RUNS_DIR [RUNS_DIR ...]
# Each RUNS_DIR holds some of de1/ .. de16/ as run_cfg.sh unpacks them (the calls may span sessions). Every call must
# be found exactly once; it refuses to pool fewer than the sixteen, and writes row D-dense-attn-de1-de16-pooled.
set -euo pipefail
[ $# -ge 1 ] || { echo "give the runs folders that hold de1 to de16" >&2; exit 2; }
ours=() native=()
for k in $(seq 1 16); do
  found=()
  for dir in "$@"; do [ -d "$dir/de$k" ] && found+=("$dir/de$k"); done
  [ ${#found[@]} -eq 1 ] || { echo "de$k found ${#found[@]} times in $*: the design pools each of the sixteen once" >&2; exit 2; }
  d=${found[0]}
  for f in "$d/alt_attn-none-1.json" "$d/alt_attn_native-none-1.json"; do
    [ -f "$f" ] || { echo "missing $f: the design pools all sixteen calls or none" >&2; exit 2; }
  done
  ours+=("$d/alt_attn-none-1.json"); native+=("$d/alt_attn_native-none-1.json")
done
out=benchmarks/results/issue5-overhead-ratios/D-dense-attn-de1-de16-pooled.json
cmd=(.venv/bin/python benchmarks/overhead_ratio.py --ours "${ours[@]}" --native "${native[@]}" --json-out "$out")
echo "${cmd[*]}" >> benchmarks/results/issue5-overhead-ratios/commands.txt
{ echo "== D-dense-attn-de1-de16-pooled"; "${cmd[@]}"; } | tee -a benchmarks/results/issue5-overhead-ratios/ratios.txt
