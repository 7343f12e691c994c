"""CPU count of the CUDA calls the raw transport makes per offloaded layer and microbatch, by kind and by caller.

On the GPU host each CUDA call costs 8-25 µs of host time inside a launch-bound step (sessions 11 and 21), and the
runtime's host time is the cost of offloading there, so the number of calls per group is a figure that can be
lowered and checked without a GPU. The layers of ``cpu_grouped_layer.py`` (``--pattern attention``: one
``core_attn`` group per layer; ``grouped``: the MoE pattern) run offloaded steps over the stub CUDA runtime of
``cpu_transport_glue.py`` built to log its calls; a step with the link telemetry's timing off (three steps in four
on the GPU) and one with it on are counted:

    python benchmarks/cpu_cuda_calls.py [--pattern attention] [--layers 8] [--microbatches 4] [--json-out FILE]

Counts, not times: the stub returns at once. Needs a C compiler (the stub is built on the fly).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_transport_glue  # noqa: E402
from cpu_grouped_layer import build_pattern, points_config  # noqa: E402

from mcore_offload.runtime import points  # noqa: E402
from mcore_offload.runtime import transport as transport_module  # noqa: E402
from mcore_offload.runtime.manager import reset  # noqa: E402

logger = logging.getLogger("cpu_cuda_calls")

#: how a logged call is named in the table: its kind, and for waits and copies the stream (d2h, h2d, compute)
STREAMS = {1: "d2h", 2: "h2d", 3: "compute"}


def call_name(call: tuple, fences: set[int]) -> str:
    op = call[0]
    if op == "record":
        return f"record on {STREAMS.get(call[2], call[2])}" + (" (fence)" if call[1] in fences else "")
    if op == "wait":
        return f"wait on {STREAMS.get(call[1], call[1])}" + (" (fence)" if call[2] in fences else "")
    if op == "copy":
        return f"copy on {STREAMS.get(call[5], call[5])}"
    return op


def count_calls(pattern: str, layers: int, microbatches: int, experts: int, steps: int = 6) -> dict:
    """Per layer and microbatch: the calls of the last untimed step and of the last timed one, by name."""
    reset()
    workdir = Path(tempfile.mkdtemp(prefix="cuda_calls_"))
    rt = cpu_transport_glue.stub_runtime(workdir, real_copies=True, log=True)
    t = cpu_transport_glue.stub_transport(rt, device_index=-1, native=True, timed_from_start=True)
    transport_module._TRANSPORTS[torch.device("cpu")] = t
    model, x, modules = build_pattern(pattern, layers, experts)
    config = points_config(modules, True)
    fences = {t._d2h_fence.handle, t._h2d_fence.handle}
    out: dict[str, dict[str, float]] = {}
    cpu_transport_glue.stub_calls(rt)
    for _ in range(steps):
        timed = t.telemetry.timing
        points.step_boundary(lambda: [model(x, config).sum().backward() for _ in range(microbatches)])()
        calls = cpu_transport_glue.stub_calls(rt)
        counts = Counter(call_name(c, fences) for c in calls)
        per = {k: round(v / (layers * microbatches), 3) for k, v in sorted(counts.items())}
        per["total"] = round(len(calls) / (layers * microbatches), 3)
        out["timed" if timed else "untimed"] = per
    transport_module._TRANSPORTS.pop(torch.device("cpu"), None)
    reset()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pattern", choices=["grouped", "attention", "attention-set"], default="attention")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("mcore_offload").setLevel(logging.WARNING)
    if cpu_transport_glue.compiler() is None:
        raise SystemExit("cpu_cuda_calls.py needs a C compiler (cc or gcc) for its stub CUDA runtime: install one")
    got = count_calls(args.pattern, args.layers, args.microbatches, args.experts)
    for kind, per in got.items():
        logger.info("%s step, CUDA calls per layer and microbatch (pattern %s):", kind, args.pattern)
        for name, n in per.items():
            logger.info("  %-26s %6.3f", name, n)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"per_layer_microbatch": got, **vars(args),
                                                   "torch": torch.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
