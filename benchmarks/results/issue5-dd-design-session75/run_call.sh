#!/usr/bin/env bash
# One call of DESIGN.md's sixteen, on the 2x H200 host after benchmarks/results/issue5-session25/setup.sh:
#   bash benchmarks/results/issue5-dd-design-session75/run_call.sh K      (K = 1..16; output $OUT/deK.tgz, as run_cfg.sh's)
# Odd K runs native first, even K ours first. It refuses a tree other than design-tree.sha1's, so that no call of the
# design measures another runtime by mistake.
set -u
k=${1:?give the call number, 1 to 16}
here=benchmarks/results/issue5-dd-design-session75
case "$k" in [1-9] | 1[0-6]) ;; *) echo "call number $k is not one of the design's 1 to 16" >&2; exit 2 ;; esac
# sorted on both sides: the host's locale orders the glob differently (auto.py / auto_choice.py, session 62)
if ! sha1sum mcore_offload/runtime/*.py mcore_offload/runtime/native/* benchmarks/pretrain_gpt.py benchmarks/pretrain_model.py \
    benchmarks/offload_stop.py | LC_ALL=C sort -k2 | diff -q - "$here/design-tree.sha1" > /dev/null; then
  echo "this tree's runtime differs from $here/design-tree.sha1: not a call of the design" >&2
  exit 3
fi
if [ $((k % 2)) -eq 1 ]; then order="alt_attn@native alt_attn"; else order="alt_attn alt_attn@native"; fi
G=de$k NPROC=2 CONFIG=D-dense ITERS=100 RUN_TIMEOUT=170 DEADLINE_S=345 VARIANTS="$order" \
  bash benchmarks/results/issue5-session30/run_cfg.sh
