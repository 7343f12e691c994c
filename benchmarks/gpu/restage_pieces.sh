#!/usr/bin/env bash
# Re-split the staged transformer-engine wheel into pieces small enough to travel with this repository's tree.
#
# Why: every device call uploads the tracked tree with what it carries, under 64 MiB in all. ../shared's stage.sh
# cuts the 186 MB wheel into four 46 MB pieces (.gpu/c1 .. c4); once the tracked tree grew past ~18 MB (session 26:
# 19.7 MB, mostly committed results) a call carrying one of them is refused. This cuts the same bytes into
# .gpu/d1 .. dN, each at most 60 MB minus the tree. The host's setup.sh joins
# /root/gpu-stage/tecu13.part0* in name order and checks the wheel's checksum, so N pieces named part00 .. part0(N-1)
# join to the same wheel (at most ten: the glob part0* stops there).
#
# With the committed results set aside first (results_aside.sh, session 47) the tree is about 5 MB and the pieces
# are four of about 46 MB.
#
#   bash ../shared/gpu-host/stage.sh && bash benchmarks/gpu/results_aside.sh aside && bash benchmarks/gpu/restage_pieces.sh
#   then one device call per piece, each within 30 s of the last, carrying .gpu/dK:
#     mkdir -p /root/gpu-stage && cp .gpu/dK/* /root/gpu-stage/
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
for i in 1 2 3 4; do [ -d ".gpu/c$i" ] || { echo "no .gpu/c$i: run bash ../shared/gpu-host/stage.sh first" >&2; exit 1; }; done
# the tracked files present: a folder set aside by results_aside.sh counts 0 (stat fails on its files)
tree=$({ git ls-files -z | xargs -0 stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
limit=60000000  # 64 MB less a margin: a call with the tree and a 46.4 MB piece (66.1 MB) was refused in session 26
piece=$((limit - tree))
[ "$piece" -gt $((8 * 1024 * 1024)) ] || { echo "the tracked tree ($tree bytes) leaves under 8 MiB a call: trim it" >&2; exit 1; }
total=$(cat .gpu/c[1-4]/tecu13.part0* | wc -c)
quarter=$(((total + 3) / 4))
[ "$piece" -le "$quarter" ] || piece=$quarter  # setup.sh checks that part00 .. part03 exist: four pieces at least
rm -rf .gpu/d[0-9]* .gpu/re && mkdir -p .gpu/re
cat .gpu/c1/tecu13.part00 .gpu/c2/tecu13.part01 .gpu/c3/tecu13.part02 .gpu/c4/tecu13.part03 \
  | split -b "$piece" -d -a 2 - .gpu/re/tecu13.part
n=$(ls .gpu/re | wc -l)
[ "$n" -le 10 ] || { echo "$n pieces: setup.sh's glob part0* takes at most ten; trim the tree" >&2; exit 1; }
k=0
for f in .gpu/re/tecu13.part*; do k=$((k + 1)); mkdir -p ".gpu/d$k"; mv "$f" ".gpu/d$k/"; done
rmdir .gpu/re
echo "tree $tree bytes; $n pieces of at most $piece bytes: .gpu/d1 .. .gpu/d$n (send each in its own call)"
