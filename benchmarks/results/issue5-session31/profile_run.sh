#!/usr/bin/env bash
# Session 31: one alternating run under torch.profiler (steps PFROM..PTO) through session 30's run_cfg.sh, then the
# per-op comparison of its offloaded and plain steps (benchmarks/trace_step_ops.py) into $OUT. G, CONFIG, VARIANTS,
# ITERS, RUN_TIMEOUT, DEADLINE_S as in run_cfg.sh. Run after benchmarks/results/issue5-session25/setup.sh.
set -u
g=${G:?}
EXTRA="--profile-steps ${PFROM:-8} ${PTO:-21} --profile-dir /tmp/prof_$g" \
  bash benchmarks/results/issue5-session30/run_cfg.sh
t=/tmp/prof_$g/trace_rank0.json.gz
if [ -f "$t" ]; then
  ls -la "$t"
  python3 benchmarks/trace_step_ops.py "$t" --top 60 --json-out "$OUT/ops_$g.json" > "$OUT/ops_$g.txt" 2>&1
  head -30 "$OUT/ops_$g.txt"
else
  echo "no trace for $g"
fi
