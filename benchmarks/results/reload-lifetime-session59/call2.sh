#!/usr/bin/env bash
# Session 59, call 2 (one H200, right after call 1): A's attention set and core_attn, then C's five points, with the
# order alternating, 60 steps, ours and native in the same call (session 58's variants, no copy-out bound), on the
# runtime that lets a reloaded storage go with its last reader. $OUT/a1.tgz and $OUT/c1.tgz (or -partial).
#   bash benchmarks/results/reload-lifetime-session59/call2.sh
set -u
bash benchmarks/results/issue5-session25/setup.sh > /dev/null 2>&1
G=a1 CONFIG=A ITERS=60 RUN_TIMEOUT=170 DEADLINE_S=330 VARIANTS="alt_attn alt_core_attn" \
  bash benchmarks/results/issue5-session30/run_cfg.sh
G=c1 CONFIG=C ITERS=60 RUN_TIMEOUT=170 DEADLINE_S=200 VARIANTS="alt_all5" bash benchmarks/results/issue5-session30/run_cfg.sh
