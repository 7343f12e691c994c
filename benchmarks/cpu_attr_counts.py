"""CPU measurement: the generic attribute reads and writes the C++ runtime makes, a layer-microbatch, by type and name.

Why: session 45's ``perf`` profile on the GPU host put half of the runtime's host time on D-dense in the Python
interpreter inside our C++ calls, and found it to be C-API work on the Python objects that hold the runtime's state
(attribute lookups, object creation), not Python frames. This counts that traffic deterministically, on the tests'
tiny dense GPT over the stub CUDA runtime of ``cpu_transport_glue.py`` (the GPU's transport and C++ paths), with a
counting build of the native module (``MCORE_OFFLOAD_NATIVE_COUNT_ATTRS=1``: every ``PyObject_GetAttr`` /
``PyObject_SetAttr`` of the runtime's C++ counted by the object's type and the name; reads and writes the C++ makes
straight to a slot, its own types' fields and the state classes' ``__slots__`` (member_slots.cpp), are not C-API
calls and are counted apart, under "direct slot accesses"). The figure a change that moves state out of Python
objects lowers; the slot accesses are the figure a change that reads the same attribute fewer times lowers (session
49's profile put about 3 ms a step of D-dense's rank 0 in the slot cache's own code).

    python benchmarks/cpu_attr_counts.py [--layout pp1|pp2vpp2] [--warmup 4] [--steps 2] [--top 40]
        [--json-out FILE]

Builds the counting module once into ``MCORE_OFFLOAD_CACHE_DIR`` (its own name; a few minutes on two cores).
Needs a C compiler (the stub is built on the fly) and the C++ toolchain of the native runtime.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

POINTS = ["qkv_linear", "core_attn", "attn_proj"]


def per_layer_mb(counts: dict[str, int], layer_mbs: int) -> dict[str, Any]:
    """``attr_counts()``'s {"get|set type.name": n} as per-layer-microbatch totals, by type and by name, largest
    first."""
    by_type: collections.Counter = collections.Counter()
    for key, n in counts.items():
        kind, attr = key.split(" ", 1)
        by_type[f"{kind} {attr.rsplit('.', 1)[0]}"] += n

    def ranked(counter: dict[str, int]) -> list[list]:
        return [[k, v / layer_mbs] for k, v in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))]

    return {"total": sum(counts.values()) / layer_mbs,
            "get": sum(n for k, n in counts.items() if k.startswith("get ")) / layer_mbs,
            "set": sum(n for k, n in counts.items() if k.startswith("set ")) / layer_mbs,
            "by_type": ranked(dict(by_type)), "by_name": ranked(counts)}


def job(rank: int, world_size: int, lib: str, vpp: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """Worker: warm-up steps, then ``args["steps"]`` counted steps; rank's counts a layer-microbatch."""
    from cpu_pipeline_host import stub_gpt

    from mcore_offload.runtime.native import load_native
    from tests.harness.gpt import run_steps

    chunks, kw = stub_gpt(lib, world_size, rank, vpp, POINTS, args["min_size"], args["layers"], args["microbatches"])
    native = load_native()
    if native is None or not hasattr(native, "attr_counts"):
        raise SystemExit("cpu_attr_counts.py: the native runtime did not load as a counting build "
                         "(MCORE_OFFLOAD_NATIVE_COUNT_ATTRS=1 with a C++ toolchain)")
    run_steps(chunks, n_steps=args["warmup"], **kw)
    native.attr_counts()  # empties the counts
    native.slot_counts()
    run_steps(chunks, n_steps=args["steps"], **kw)
    counts = native.attr_counts()
    slots = native.slot_counts()
    layer_mbs = args["layers"] // world_size * args["microbatches"] * args["steps"]
    return {"layer_microbatches_a_step": layer_mbs // args["steps"], **per_layer_mb(counts, layer_mbs),
            "slots": per_layer_mb(slots, layer_mbs)}


def print_ranked(counts: dict[str, Any], top: int) -> None:
    """``per_layer_mb``'s rows, by type and by name, the ``top`` largest of each."""
    for title, rows in (("by type", counts["by_type"]), ("by name", counts["by_name"])):
        print(f"  {title}:")
        for key, per in rows[:top]:
            print(f"  {per:>9.2f}  {key}")


def main(argv: list[str] | None = None) -> int:
    from cpu_pipeline_host import rank0_on_stub, stub_layout_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stub_layout_args(p, steps=2)
    args = p.parse_args(argv)
    os.environ["MCORE_OFFLOAD_NATIVE_COUNT_ATTRS"] = "1"  # the workers inherit it: they build or load that module
    os.environ.setdefault("MCORE_OFFLOAD_NATIVE", "1")
    out = rank0_on_stub(job, args.layout, vars(args), timeout_s=900)
    print(f"rank 0, {args.layout}, {out['layer_microbatches_a_step']} layer-microbatches a step: "
          f"{out['total']:.1f} generic attribute calls of the C++ runtime a layer-microbatch "
          f"({out['get']:.1f} reads, {out['set']:.1f} writes)")
    print_ranked(out, args.top)
    slots = out["slots"]
    print(f"direct slot accesses (member_slots.cpp, not C-API calls): {slots['total']:.1f} a layer-microbatch "
          f"({slots['get']:.1f} reads, {slots['set']:.1f} writes)")
    print_ranked(slots, args.top)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), **out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
