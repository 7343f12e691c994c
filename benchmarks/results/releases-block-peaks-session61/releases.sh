#!/usr/bin/env bash
# Session 61: the GPU check of the other megatron-core releases of pyproject's range (0.15.0, 0.15.1, 0.15.2; the
# CPU tests run on them in `make test-releases`). For each version given: install its cp312 wheel (carried in
# .gpu/rel, fetched on the dev machine with `pip download --no-deps --python-version 3.12 --platform
# manylinux_2_28_x86_64 --only-binary=:all: megatron-core==V`) into /root/mc-V, patch it with `mcore-offload patch
# apply`, then
#  - A at 4 layers: tests/test_gpu.py's block-recompute test (core_attn and the attention set under full recompute
#    of the first 2 layers: loss equal, peak lower, no pinned allocation after step 0, bytes equal to the planner's);
#  - C at 4 layers: peak_memory.py with expert_fc1+moe_act and all five points (no recompute).
# After the four staging calls and setup (call 1), carrying .gpu/w and .gpu/rel:
#   bash benchmarks/results/releases-block-peaks-session61/releases.sh 0.15.0 0.15.1
# Writes $OUT/V.tgz holding V/{install.txt,patch.txt,pytest.txt,pt/...,C/...}.
set -u
out=${OUT:?}
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
for v in "$@"; do
  d="$out/$v"; mkdir -p "$d"
  tree=/root/mc-$v
  [ -d "$tree/megatron" ] || python3 -m pip install -q --no-deps --no-index --target "$tree" \
    .gpu/rel/megatron_core-"$v"-cp312-*.whl > "$d/install.txt" 2>&1
  python3 -m mcore_offload patch apply --megatron-path "$tree" > "$d/patch.txt" 2>&1
  PYTHONPATH="$tree:$PYTHONPATH" python3 -c "
import megatron.core; from megatron.core.package_info import __version__ as v
print('megatron-core', v, megatron.core.__file__)" >> "$d/patch.txt" 2>&1
  tail -1 "$d/patch.txt"
  MCORE_OFFLOAD_MEGATRON=$tree timeout 170 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_gpu.py \
    -rfs --tb=short -k "block_full_recompute" --basetemp "$d/pt" > "$d/pytest.txt" 2>&1
  grep -E "PASSED|FAILED|passed|failed" "$d/pytest.txt" | tail -2
  timeout 150 python3 benchmarks/peak_memory.py --config C --impls baseline ours --ours-megatron "$tree" \
    --train-iters 10 --timeout 120 --out "$d/C" --sets expert_fc1+moe_act \
    qkv_linear+core_attn+attn_proj+expert_fc1+moe_act "--extra=--num-layers 4" > "$d/C.txt" 2>&1
  tail -4 "$d/C/results.md" 2>/dev/null
  tar czf "$out/$v.tgz" -C "$out" "$v" && rm -rf "$d"  # one file: the device tool returns few files, no '+' names
done
