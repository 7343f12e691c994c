#!/usr/bin/env bash
# Session 60, call 2 (one H200, right after call 1): A's attention set and core_attn with the order alternating,
# 60 steps, ours and native in the same call (as session 59's call 2), on the runtime of session 59's final head
# plus session 60's planner work (the runtime's files unchanged since f35a6da). $OUT/a1.tgz (or -partial).
#   bash benchmarks/results/block-recompute-session60/call2.sh
set -u
bash benchmarks/results/issue5-session25/setup.sh > /dev/null 2>&1
G=a1 CONFIG=A ITERS=60 RUN_TIMEOUT=170 DEADLINE_S=330 VARIANTS="alt_attn alt_core_attn" \
  bash benchmarks/results/issue5-session30/run_cfg.sh
