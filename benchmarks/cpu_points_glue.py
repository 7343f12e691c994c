"""CPU microbenchmark: the host time of the offload points' own glue, A's three chained points a layer.

Each layer calls ``offload``/``commit`` for ``qkv_linear``, ``core_attn`` and ``attn_proj`` around empty bodies
(nothing saved, nothing copied), inside a chunk's forward over the stub CUDA transport of ``cpu_grouped_layer.py``:
what is left is the points' decision, the group, the start and commit hooks' registration and the saved-tensor hooks'
push and pop. Runs of 64 layers alternate in one process between the C++ glue (``runtime/native/points_block.cpp``)
and points.py's Python glue (the manager's ``native_points`` switched between runs, as ``MCORE_OFFLOAD_NATIVE_POINTS``
sets it): separate processes on the development machine differ by more than the two do. The garbage collector is off
and the handler's lists are emptied between runs. Result: µs a layer for each, the fastest run and the median, and the
median of the paired differences (Python less C++):

    python benchmarks/cpu_points_glue.py [--reps 300] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cpu_grouped_layer  # noqa: E402

from mcore_offload.runtime import points  # noqa: E402
from mcore_offload.runtime.manager import get_manager, reset  # noqa: E402

POINTS = ("qkv_linear", "core_attn", "attn_proj")
LAYERS = 64


def three_points(config: object, x: torch.Tensor) -> None:
    for name in POINTS:
        with points.offload(name, config, x):
            pass
        points.commit(name, config, x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=300, help="runs of each glue")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    reset()
    cpu_grouped_layer.install_stub_transport()
    config = cpu_grouped_layer.points_config(list(POINTS), True)
    manager = get_manager()
    points.begin_chunk(config, None, torch.nn.Linear(4, 4))
    handler = manager.forward_handler
    if manager.native is None:
        raise SystemExit("the C++ runtime did not load here (MCORE_OFFLOAD_NATIVE): nothing to compare")
    times: dict[str, list[float]] = {"C++": [], "Python": []}
    gc.disable()
    try:
        for _ in range(args.reps):
            for glue in ("C++", "Python"):
                manager.native_points = manager.native if glue == "C++" else None
                inputs = [torch.randn(4, requires_grad=True) * 1 for _ in range(LAYERS)]  # each with a node to hook
                t0 = time.perf_counter_ns()
                for x in inputs:
                    three_points(config, x)
                times[glue].append((time.perf_counter_ns() - t0) / LAYERS / 1e3)
                handler.opened.clear()
                handler.groups.clear()
                handler.pending.clear()
    finally:
        gc.enable()
        logging.getLogger("mcore_offload").setLevel(logging.ERROR)  # the chunk never runs backward: no abort notice
        reset()
    out = {glue: {"fastest_us": min(t), "median_us": statistics.median(t)} for glue, t in times.items()}
    saved = statistics.median(p - c for c, p in zip(times["C++"], times["Python"]))
    for glue, r in out.items():
        print(f"three chained points, {glue} glue: fastest {r['fastest_us']:.2f}, median {r['median_us']:.2f} us a "
              f"layer ({args.reps} runs of {LAYERS} layers)")
    print(f"Python less C++, median of the paired runs: {saved:.2f} us a layer")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"glue": out, "python_less_cpp_us": saved, **vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
