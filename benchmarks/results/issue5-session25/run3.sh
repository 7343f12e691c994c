#!/usr/bin/env bash
# Session 25, the lasting plain-step slowness: ours offloads in steps 0..11 only, then idles, releasing nothing /
# the device cache / the host buffers first; against ours idle throughout (G names the output folder).
set -u
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
mkdir -p /tmp/r
NPROC=2 CONFIG=D-dense COSTS=0 REPS=${REPS:-2} ITERS=60 RUN_TIMEOUT=150 \
  VARIANTS="${VARIANTS:-stop_core_attn idle_core_attn stopec_core_attn stoph_core_attn}" \
  bash benchmarks/gpu/issue5_host.sh /tmp/r/${G:-s1} > /tmp/r/${G:-s1}.txt 2>&1
grep -v "^  breakdown" /tmp/r/${G:-s1}.txt | tail -30
rm -f /tmp/r/*/host_topology.txt
tar czf $OUT/${G:-s1}.tgz -C /tmp/r ${G:-s1} ${G:-s1}.txt tree.txt
