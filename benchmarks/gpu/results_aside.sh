#!/usr/bin/env bash
# Move the committed results out of the working tree for the device calls, and back afterwards.
#
# Why: every device call uploads the working tree (the tracked files present, the untracked ones git does not ignore)
# with what it carries, 64 MiB in all. By session 47 benchmarks/results held 38 of the tree's 41 MB, which left
# under 19 MB a call for the transformer-engine wheel: ten staging calls, and no room for one more session's results
# (restage_pieces.sh allows ten pieces). The GPU calls need only the result folders whose scripts they run
# (issue5-session25/setup.sh, issue5-session30/run_cfg.sh, issue5-session44/perf_run.sh). Aside, the tree is about
# 6 MB and the wheel goes in the four pieces of ../shared's stage.sh.
#
#   bash benchmarks/gpu/results_aside.sh aside   # before restage_pieces.sh and the device calls
#   bash benchmarks/gpu/results_aside.sh back    # after the last device call, before any commit
#
# The folders wait in .gpu/aside (ignored by git, never carried). A session's new results folder is created after
# `aside` and is not touched. `back` refuses to overwrite a folder of the same name. Tried in session 47: with the
# results aside (tree 5.0 MB) a call carrying a 46.4 MB piece went through; the device's copy still listed older
# result folders (its own earlier copy of the tree, it seems), which the GPU calls do not read.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
# the setup, run and perf-run scripts of the GPU calls; the D-dense designs' run_call.sh (sessions 55, 75) and session
# 78's runtime A/B (ab_call.sh), session 79's chunk-cost call (chunk_call.sh); the census run
keep=" issue5-session25 issue5-session30 issue5-session44 issue5-session55 issue5-dd-design-session75 issue5-session78 issue5-session79 planner-census-session56 planner-fused-paths-session57 d2h-in-flight-session58 "
case "${1:-}" in
  aside)
    [ ! -e .gpu/aside ] || { echo ".gpu/aside exists: run 'bash $0 back' first" >&2; exit 1; }
    mkdir -p .gpu/aside
    n=0
    for d in benchmarks/results/*/; do
      name=$(basename "$d")
      case "$keep" in *" $name "*) continue ;; esac
      mv "$d" .gpu/aside/
      n=$((n + 1))
    done
    # the tracked files present: a folder set aside by results_aside.sh counts 0 (stat fails on its files)
    tree=$({ git ls-files -z | xargs -0 stat -c %s 2>/dev/null || true; } | awk '{s += $1} END {print s + 0}')
    echo "$n result folders aside in .gpu/aside; the working tree's tracked files now $tree bytes" \
      "(put them back with: bash $0 back)"
    ;;
  back)
    [ -d .gpu/aside ] || { echo "nothing aside (.gpu/aside is missing)" >&2; exit 1; }
    for d in .gpu/aside/*/; do
      name=$(basename "$d")
      [ ! -e "benchmarks/results/$name" ] || {
        echo "benchmarks/results/$name exists beside .gpu/aside/$name: move one of them by hand" >&2
        exit 1
      }
    done
    mv .gpu/aside/*/ benchmarks/results/
    rmdir .gpu/aside
    echo "result folders back in benchmarks/results"
    ;;
  *)
    echo "usage: bash $0 aside|back" >&2
    exit 2
    ;;
esac
