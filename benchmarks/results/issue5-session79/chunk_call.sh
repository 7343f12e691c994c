#!/usr/bin/env bash
# One call of README.md's chunk-cost measurement, on the 2x H200 host after benchmarks/results/issue5-session25/setup.sh:
#   bash benchmarks/results/issue5-session79/chunk_call.sh K "ORDER"   (ORDER: "vpp pp" or "pp vpp")
# "vpp" is D-dense (PP=2 x VPP=2: 16 chunk-microbatches a step on each rank), "pp" is E-pp2 (the same model at PP=2
# without VPP: 8), both with the attention set, offloaded and plain steps alternating, ours only. Each layout's run
# goes to its own folder ($OUT/ckK-vpp.tgz, $OUT/ckK-pp.tgz), so no run overwrites another.
set -u
k=${1:?give the call number}
order=${2:?give the order, e.g. "vpp pp"}
for layout in $order; do
  case $layout in vpp) config=D-dense ;; pp) config=E-pp2 ;; *) echo "order names vpp or pp, not $layout" >&2; exit 2 ;; esac
  G=ck$k-$layout NPROC=2 CONFIG=$config ITERS=${ITERS:-80} RUN_TIMEOUT=170 DEADLINE_S=180 VARIANTS="alt_attn" \
    bash benchmarks/results/issue5-session30/run_cfg.sh
done
