#!/usr/bin/env bash
# Session 25, device call 2: is the plain-step gap ours? baseline, ours idle every step, ours alternating.
set -u
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
mkdir -p /tmp/r
NPROC=2 CONFIG=D-dense COSTS=0 REPS=${REPS:-3} ITERS=60 RUN_TIMEOUT=150 VARIANTS="${VARIANTS:-baseline idle_core_attn alt_core_attn}" \
  bash benchmarks/gpu/issue5_host.sh /tmp/r/${G:-g1} > /tmp/r/${G:-g1}.txt 2>&1
tail -40 /tmp/r/${G:-g1}.txt
rm -f /tmp/r/*/host_topology.txt
tar czf $OUT/${G:-g1}.tgz -C /tmp/r ${G:-g1} ${G:-g1}.txt
