"""CPU measurement: the runtime's host time a step at PP=1 against PP=2 x VPP=2, and where the difference goes.

On the GPU host the runtime clocks 28-33 ms a step on D-dense's rank 0 (PP=2 x VPP=2, 64 layer-microbatches a rank)
against 21-25 ms on A (PP=1, also 64), and in a launch-bound step that host time is step time (sessions 38-40). This
runs the tests' tiny dense GPT (megatron-core's local spec, gloo) with the given points over the stub CUDA runtime of
``cpu_transport_glue.py`` (the GPU's transport and C++ paths; CUDA calls return at once, copies are memcpy), once per
layout, with the same layers and microbatches, and prints per layout: the runtime's own clock a step and per
layer-microbatch (``summary.runtime_total_ns()``, the figure ``pretrain_gpt.py`` reports as ``runtime host ms``),
and, with ``--breakdown``, the inclusive time of each runtime function (``runtime_breakdown.py``; its wrappers add
their own cost, and it times the Python points' glue, so read its rows against each other, not against the clock):

    python benchmarks/cpu_pipeline_host.py [--layers 16] [--microbatches 8] [--steps 12] [--breakdown]
        [--layouts pp1 pp2 pp2vpp2] [--points qkv_linear core_attn attn_proj] [--paired] [--min-size N] [--python-glue]
        [--without pack-hooks node-hooks] [--json-out FILE]

``--paired`` runs each measured offloaded step next to one inside ``mcore_offload.paused()`` and prints the step time
offloading adds beside the runtime's clock: the difference is what the clock does not see (the autograd engine's
calls into the saved-tensor and node hooks, the glue's own Python calls). ``--min-size`` above every activation
(or ``--without``, which also takes parts of the Python glue away) leaves the points running with nothing to move.

Rank 0 is the pipeline's first stage (the D rows' rank 0). Needs a C compiler (the stub is built on the fly).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

logger = logging.getLogger("cpu_pipeline_host")

#: layout name -> (pipeline size, virtual pipeline size or None); ``pp2`` (opt-in: ``--layouts pp2 pp2vpp2``) has the
#: same layer-microbatches per rank as ``pp2vpp2`` and half its chunk-microbatches (session 79's E-pp2 against D-dense)
LAYOUTS = {"pp1": (1, None), "pp2": (2, None), "pp2vpp2": (2, 2)}


def stub_gpt(lib: str, world_size: int, rank: int, vpp: int | None, points: list[str], min_size: int, layers: int,
             microbatches: int, hidden: int = 64, seq_len: int = 32) -> tuple[list, dict[str, Any]]:
    """The tests' tiny dense GPT with ``points`` offloading over the stub CUDA runtime ``lib`` (its transport as the
    CPU's), in a fresh runtime; returns the model chunks and ``run_steps``' keyword arguments."""
    import ctypes

    import cpu_transport_glue
    import torch

    from mcore_offload.runtime import cudart
    from mcore_offload.runtime import transport as transport_module
    from mcore_offload.runtime.manager import reset
    from tests.harness.gpt import build_dense_gpt, init_parallel

    init_parallel(world_size, rank, pp=world_size, vpp=vpp)
    reset()
    rt = cudart.CudaRuntime(ctypes.CDLL(lib))
    transport_module._TRANSPORTS[torch.device("cpu")] = cpu_transport_glue.stub_transport(rt, -1, native=True)
    overrides = dict(fine_grained_activation_offloading=True, offload_modules=list(points),
                     min_offloaded_tensor_size=min_size)
    chunks = build_dense_gpt(num_layers=layers, hidden_size=hidden, num_attention_heads=4, config_overrides=overrides)
    return chunks, dict(num_microbatches=microbatches, seq_len=seq_len, micro_batch_size=2, lr=0.01)


def rank0_on_stub(job: Any, layout: str, args: dict[str, Any], timeout_s: int = 600) -> Any:
    """``job(rank, world_size, lib, vpp, args)`` on every rank of ``layout`` over a fresh stub CUDA runtime (built
    on the fly); rank 0's answer. The one-layout tools (``cpu_runtime_python.py``, ``cpu_attr_counts.py``) use it."""
    import cpu_transport_glue

    from tests.harness.multiproc import run_multiprocess

    pp, vpp = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as tmp:
        lib = cpu_transport_glue.stub_library(Path(tmp), real_copies=True)
        return run_multiprocess(job, pp, args=(lib, vpp, args), timeout_s=timeout_s)[0]


def stub_layout_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The one-layout tools' common options: the layout, the model's size, the steps, what moves, the output."""
    p.add_argument("--layout", choices=list(LAYOUTS), default="pp2vpp2")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--min-size", type=int, default=512, help="min_offloaded_tensor_size (elements): what moves")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json-out")


def layout_job(rank: int, world_size: int, lib: str, vpp: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """Worker: offloaded steps over the stub transport; the runtime's clock per step and, optionally, its breakdown."""
    from mcore_offload.summary import get_summary
    from tests.harness.gpt import run_steps

    if args["python_glue"] or args["without"]:
        _python_glue_without(args["without"])
    breakdown = None
    if args["breakdown"]:
        from runtime_breakdown import RuntimeBreakdown

        breakdown = RuntimeBreakdown()
        breakdown.install()
    chunks, kw = stub_gpt(lib, world_size, rank, vpp, args["points"], args["min_size"], args["layers"],
                          args["microbatches"], args["hidden"], args["seq_len"])
    run_steps(chunks, n_steps=args["warmup"], **kw)
    if breakdown is not None:
        breakdown.recording = True
    out: dict[str, Any] = {}
    if args["paired"]:
        out["paired"] = paired_steps(chunks, args["steps"], kw)
    else:
        run_steps(chunks, n_steps=args["steps"], **kw)
    if breakdown is not None:
        breakdown.recording = False
    summary = get_summary()
    steps = summary.steps[-args["steps"]:]  # only steps that offloaded something are recorded
    out |= {"runtime_ms": [s.runtime_cpu_ms for s in steps],  # empty where nothing moved (--paired clocks those)
            "layer_microbatches": args["layers"] // world_size * args["microbatches"],
            # what moved: layouts that copy out more of their layers do more work per layer
            "offloaded_bytes": summary.last_step.total("offloaded") if summary.last_step is not None else 0}
    if breakdown is not None:
        out["breakdown"] = breakdown.as_dict(args["steps"])
    return out


def _python_glue_without(parts: list[str]) -> None:
    """The points' Python glue (``MCORE_OFFLOAD_NATIVE_POINTS=0``, read when the manager is made), less ``parts``:
    ``pack-hooks`` (no saved-tensor hooks pushed) and ``node-hooks`` (no pre-hooks on autograd nodes). Only with
    nothing to move (``--without`` sets the size threshold above every activation): what each costs a step where
    the points run and nothing is offloaded."""
    import point_switches

    from mcore_offload.runtime import points

    os.environ["MCORE_OFFLOAD_NATIVE_POINTS"] = "0"
    if "pack-hooks" in parts:
        point_switches.without_pack_hooks()
    if "node-hooks" in parts:
        points._hook_node = lambda tensor, manager, hook: True


def paired_steps(chunks: list, n: int, kw: dict[str, Any]) -> dict[str, list[float]]:
    """``n`` offloaded steps, each followed by one inside ``mcore_offload.paused()`` (the patches and the runtime in
    place, nothing offloaded), timed on the wall clock: the offloaded step's extra time beside the runtime's own clock
    says how much of it the clock sees (what it misses: the autograd engine's calls into the hooks, the allocator,
    the model's own code running slower)."""
    import time

    import torch.distributed as dist

    from mcore_offload import paused
    from mcore_offload.summary import get_summary
    from tests.harness.gpt import run_steps

    summary = get_summary()
    on, off, clock = [], [], []
    for _ in range(n):
        for times, ctx in ((on, contextlib.nullcontext), (off, paused)):
            dist.barrier()  # every rank starts the step together: a rank's time is then its own and its waits
            records, ns = len(summary.steps), summary.runtime_total_ns()
            t0 = time.perf_counter()
            with ctx():
                run_steps(chunks, n_steps=1, **kw)
            times.append((time.perf_counter() - t0) * 1e3)
            if times is on:  # a step that offloaded nothing leaves no record, and its clock runs on
                clock.append(summary.steps[-1].runtime_cpu_ms if len(summary.steps) > records
                             else (summary.runtime_total_ns() - ns) / 1e6)
    return {"on_ms": on, "off_ms": off, "clock_ms": clock}


def measure(layout: str, lib: str, args: dict[str, Any]) -> list[dict[str, Any]]:
    from tests.harness.multiproc import run_multiprocess

    pp, vpp = LAYOUTS[layout]
    return run_multiprocess(layout_job, pp, args=(lib, vpp, args), timeout_s=600)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--points", nargs="+", default=["qkv_linear", "core_attn", "attn_proj"])
    p.add_argument("--layouts", nargs="+", default=["pp1", "pp2vpp2"], choices=list(LAYOUTS))
    p.add_argument("--breakdown", action="store_true", help="time each runtime function (runtime_breakdown.py)")
    p.add_argument("--min-size", type=int, default=512,
                   help="min_offloaded_tensor_size (elements); above every activation, the points and hooks run and "
                        "nothing moves")
    p.add_argument("--python-glue", action="store_true", help="the points' Python glue (MCORE_OFFLOAD_NATIVE_POINTS=0)")
    p.add_argument("--without", nargs="+", default=[], choices=["pack-hooks", "node-hooks"],
                   help="the Python glue without these, and nothing to move (sets --min-size above every "
                        "activation): what each costs a step")
    p.add_argument("--paired", action="store_true",
                   help="each offloaded step followed by a paused one (nothing offloaded): the step time offloading "
                        "adds, beside the runtime's own clock")
    p.add_argument("--top", type=int, default=25, help="breakdown rows to print")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.layers % 4:
        raise SystemExit(f"--layers {a.layers}: give a multiple of 4, so that PP=2 x VPP=2 has whole chunks")

    import cpu_transport_glue

    if a.without:
        a.min_size = 2**40
    args = {k: getattr(a, k) for k in ("layers", "microbatches", "hidden", "seq_len", "warmup", "steps", "points",
                                      "breakdown", "paired", "min_size", "python_glue", "without")}
    results: dict[str, Any] = {"args": args, "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        lib = cpu_transport_glue.stub_library(Path(tmp), real_copies=True)
        for layout in a.layouts:
            logger.info("layout %s: %d warm-up and %d measured steps ...", layout, a.warmup, a.steps)
            results["layouts"][layout] = measure(layout, lib, args)
    logger.info("%-8s %5s %12s %16s %18s %14s", "layout", "rank", "ms a step", "us a layer-mb",
                "offloaded KiB", "us a MiB")
    for layout, ranks in results["layouts"].items():
        for rank, r in enumerate(ranks):
            r["median_ms"] = statistics.median(r["runtime_ms"]) if r["runtime_ms"] else None
            med = float("nan") if r["median_ms"] is None else r["median_ms"]
            mib = r["offloaded_bytes"] / 2**20
            logger.info("%-8s %5d %12.2f %16.1f %18.0f %14.1f", layout, rank, med, med * 1e3 / r["layer_microbatches"],
                        mib * 1024, med * 1e3 / mib if mib else float("nan"))
    if a.paired:
        logger.info("%-8s %5s %16s %16s %16s %14s", "layout", "rank", "on ms (median)", "off ms (median)",
                    "added ms (med.)", "runtime clock")
        for layout, ranks in results["layouts"].items():
            for rank, r in enumerate(ranks):
                on, off = r["paired"]["on_ms"], r["paired"]["off_ms"]
                r["added_ms_median"] = statistics.median(x - y for x, y in zip(on, off))
                logger.info("%-8s %5d %16.2f %16.2f %16.2f %14.2f", layout, rank, statistics.median(on),
                            statistics.median(off), r["added_ms_median"], statistics.median(r["paired"]["clock_ms"]))
    if a.breakdown:
        rows = {layout: ranks[0]["breakdown"]["functions"] for layout, ranks in results["layouts"].items()}
        names = sorted({n for r in rows.values() for n in r},
                       key=lambda n: -max(r.get(n, {}).get("us_per_step", 0) for r in rows.values()))
        logger.info("rank 0, inclusive us a step (calls a step):")
        logger.info("%-48s" + " %22s" * len(rows), "function", *rows)
        for n in names[:a.top]:
            cells = [f"{r[n]['us_per_step']:9.1f} ({r[n]['calls_per_step']:7.1f})" if n in r else "-" for r in
                     rows.values()]
            logger.info("%-48s" + " %22s" * len(rows), n, *cells)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
