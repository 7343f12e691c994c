#!/usr/bin/env bash
# One call of README.md's runtime A/B, on the 2x H200 host after benchmarks/results/issue5-session25/setup.sh and with
# .gpu/old (93d3b58's mcore_offload, made as README.md says) carried:
#   bash benchmarks/results/issue5-session78/ab_call.sh K "ORDER"   (output $OUT/abK.tgz; ORDER "old new" or "new old")
# "old" is alt_attn@old (OLD_TREE=.gpu/old), "new" alt_attn (this tree). It refuses trees other than the two designs'
# pinned runtimes, so that the A/B compares exactly the runtimes of dd1-dd10 and de1-de16.
set -u
k=${1:?give the call number}
order=${2:?give the order, e.g. "old new"}
# one run of each runtime a call: issue5_host.sh names a run's files after its variant, so a second "old" or "new"
# in one call overwrote the first (call 2 of session 78 lost its first two runs that way)
for v in old new; do
  [ "$(echo $order | tr ' ' '\n' | grep -c "^$v$")" -le 1 ] || { echo "one old and one new a call: \"$order\" repeats $v" >&2; exit 2; }
done
old=.gpu/old
if ! (cd "$old" && sha1sum mcore_offload/runtime/*.py mcore_offload/runtime/native/*) | LC_ALL=C sort -k2 \
    | diff -q - <(grep ' mcore_offload/' benchmarks/results/issue5-session55/design-tree.sha1 | LC_ALL=C sort -k2) > /dev/null; then
  echo "$old is not session 55's design runtime (93d3b58)" >&2; exit 3
fi
if ! sha1sum mcore_offload/runtime/*.py mcore_offload/runtime/native/* benchmarks/pretrain_gpt.py benchmarks/pretrain_model.py \
    benchmarks/offload_stop.py | LC_ALL=C sort -k2 | diff -q - benchmarks/results/issue5-dd-design-session75/design-tree.sha1 > /dev/null; then
  echo "this tree's runtime is not session 75's design runtime (c653cee)" >&2; exit 3
fi
variants=""
for v in $order; do
  case $v in old) variants="$variants alt_attn@old" ;; new) variants="$variants alt_attn" ;;
    *) echo "order names old or new, not $v" >&2; exit 2 ;; esac
done
# build the old runtime's C++ before the clock starts (its sources hash to their own cache folder)
mkdir -p /tmp/r
PYTHONPATH=$PWD/$old${PYTHONPATH:+:$PYTHONPATH} python3 -m mcore_offload build-native > /tmp/r/old-build-$k.txt 2>&1 \
  || { tail -5 /tmp/r/old-build-$k.txt; exit 4; }
tail -1 /tmp/r/old-build-$k.txt
n=$(echo $order | wc -w)
OLD_TREE=$PWD/$old G=ab$k NPROC=2 CONFIG=D-dense ITERS=100 RUN_TIMEOUT=170 DEADLINE_S=$((n * 135 + 30)) VARIANTS="$variants" \
  bash benchmarks/results/issue5-session30/run_cfg.sh
