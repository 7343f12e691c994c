"""CPU measurement: the Python functions of ``mcore_offload`` an offloaded step runs, with calls per layer-microbatch.

Why: under ``perf`` on the GPU host (session 44, ``perf_steps.py``) half of the runtime's host time on D-dense is
the Python interpreter, reached from the C++ paths (the handler's, manager's, transport's and telemetry's methods)
and from the points' own Python entries. Moving that layer into C++ is a port over many small functions; this
counts what is left of it, deterministically (call counts do not depend on this machine's speed), on the tests' tiny
dense GPT over the stub CUDA runtime of ``cpu_transport_glue.py`` (the GPU's transport and C++ paths). ``cProfile``
sees every Python function call, including those made from C++.

    python benchmarks/cpu_runtime_python.py [--layout pp1|pp2vpp2] [--warmup 4] [--steps 4] [--top 40]
        [--json-out FILE]

Per rank 0: every ``mcore_offload`` Python function run in the measured steps, its calls per layer-microbatch and
its own time (µs a layer-microbatch, with cProfile's overhead, so only for ranking), and the total calls per
layer-microbatch: the figure a port lowers. Needs a C compiler (the stub is built on the fly).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

POINTS = ["qkv_linear", "core_attn", "attn_proj"]


def job(rank: int, world_size: int, lib: str, vpp: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """Worker: warm-up steps, then ``args["steps"]`` steps under cProfile; the runtime's functions per step."""
    from cpu_pipeline_host import stub_gpt

    from tests.harness.gpt import run_steps

    chunks, kw = stub_gpt(lib, world_size, rank, vpp, POINTS, args["min_size"], args["layers"], args["microbatches"])
    # the first offloading steps allocate and announce, and steps 0-3 are all timed by the link telemetry; from
    # step 4 on one step in MCORE_OFFLOAD_TELEMETRY_EVERY (4) is, so the default warm-up of 4 measures steps as a
    # long run has them
    run_steps(chunks, n_steps=args["warmup"], **kw)
    profile = cProfile.Profile()
    profile.enable()
    run_steps(chunks, n_steps=args["steps"], **kw)
    profile.disable()
    layer_mbs = args["layers"] // world_size * args["microbatches"] * args["steps"]
    rows = []
    for (path, line, name), (_, calls, own, _, _) in pstats.Stats(profile).stats.items():
        if "/mcore_offload/" in path:
            rows.append({"function": f"{Path(path).name}:{line}:{name}", "calls_per_layer_mb": calls / layer_mbs,
                         "own_us_per_layer_mb": own * 1e6 / layer_mbs})
    rows.sort(key=lambda r: (-r["calls_per_layer_mb"], r["function"]))
    return {"rows": rows, "calls_per_layer_mb": sum(r["calls_per_layer_mb"] for r in rows),
            "layer_microbatches_a_step": layer_mbs // args["steps"]}


def main(argv: list[str] | None = None) -> int:
    from cpu_pipeline_host import rank0_on_stub, stub_layout_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stub_layout_args(p, steps=4)
    args = p.parse_args(argv)
    out = rank0_on_stub(job, args.layout, vars(args))
    print(f"rank 0, {args.layout}, {out['layer_microbatches_a_step']} layer-microbatches a step: "
          f"{out['calls_per_layer_mb']:.1f} Python calls of mcore_offload a layer-microbatch")
    print(f"  {'calls / layer-mb':>16} {'own µs / layer-mb':>18}  function")
    for r in out["rows"][:args.top]:
        print(f"  {r['calls_per_layer_mb']:>16.2f} {r['own_us_per_layer_mb']:>18.2f}  {r['function']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), **out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
