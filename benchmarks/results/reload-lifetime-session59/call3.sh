#!/usr/bin/env bash
# Session 59, call 3 (one H200), after re-staging: the runtime that also lets a group's saved refs go when backward
# reaches the group (the kept last layer's tensors then go with their readers). The CUDA-path GPU tests, the toy's
# diagnosis (diagnose.py), session 58's local-spec runs F4, P4 and P4 with the bound, then A's attention set
# alternating (60 steps). $OUT: pytest_gpu.txt, diagnose.txt, call3.tgz, a3.tgz (or -partial).
#   bash benchmarks/results/reload-lifetime-session59/call3.sh
set -u
out=${OUT:?}
here=benchmarks/results/reload-lifetime-session59
bash benchmarks/results/issue5-session25/setup.sh > /dev/null 2>&1
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
cp /tmp/r/setup.txt /tmp/r/tree.txt "$out/"
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  -k "cuda_ or fault or forward_only or deterministic" > "$out/pytest_gpu.txt" 2>&1
tail -3 "$out/pytest_gpu.txt"
timeout 150 python3 $here/diagnose.py > "$out/diagnose.txt" 2>&1
grep -v -i warn "$out/diagnose.txt" | tail -32
bash benchmarks/results/d2h-in-flight-session58/bound.sh "$out" call3 F4:F4-local-det:0:2:0 \
  P4-ifl0:P4-local-dense5-det:0:2:0 P4-ifl1:P4-local-dense5-det:1:2:0
G=a3 CONFIG=A ITERS=60 RUN_TIMEOUT=170 DEADLINE_S=200 VARIANTS="alt_attn" bash benchmarks/results/issue5-session30/run_cfg.sh
