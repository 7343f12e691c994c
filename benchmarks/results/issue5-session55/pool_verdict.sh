#!/usr/bin/env bash
# The design's one verdict (DESIGN.md "How it is read"), on the development machine once dd10 has run:
#   bash benchmarks/results/issue5-session55/pool_verdict.sh RUNS_DIR_OF_DD7_TO_DD10
# dd1-dd6 ran in session 62 (benchmarks/results/issue5-session62/runs); RUNS_DIR holds dd7/ .. dd10/ as run_cfg.sh
# unpacks them. It refuses to pool fewer than the ten calls, and writes row D-dense-attn-dd1-dd10-pooled.
set -euo pipefail
later=${1:?give the runs folder that holds dd7 to dd10}
first=benchmarks/results/issue5-session62/runs
ours=() native=()
for k in 1 2 3 4 5 6 7 8 9 10; do
  if [ "$k" -le 6 ]; then d=$first/dd$k; else d=$later/dd$k; fi
  for f in "$d/alt_attn-none-1.json" "$d/alt_attn_native-none-1.json"; do
    [ -f "$f" ] || { echo "missing $f: the design pools all ten calls or none" >&2; exit 2; }
  done
  ours+=("$d/alt_attn-none-1.json"); native+=("$d/alt_attn_native-none-1.json")
done
out=benchmarks/results/issue5-overhead-ratios/D-dense-attn-dd1-dd10-pooled.json
cmd=(.venv/bin/python benchmarks/overhead_ratio.py --ours "${ours[@]}" --native "${native[@]}" --json-out "$out")
echo "${cmd[*]}" >> benchmarks/results/issue5-overhead-ratios/commands.txt
{ echo "== D-dense-attn-dd1-dd10-pooled"; "${cmd[@]}"; } | tee -a benchmarks/results/issue5-overhead-ratios/ratios.txt
