"""CPU microbenchmark: what a group's node hooks cost, registered from Python or in C++ (``runtime/native``).

Every offloaded group puts two hooks on existing autograd nodes (``points.py``: ``StartHook`` on the node that made
the point's input, ``CommitHook`` on the node that made its output). This times a chain of ``--nodes`` custom
autograd nodes (TE's modules are such nodes) through forward and backward, with one hook per node registered by
``Node.register_prehook`` (Python) or by ``add_prehook`` (C++), against the same chain without hooks; the three
kinds of step alternate in one process. The result is the median paired difference per hook, registration and call
together:

    python benchmarks/cpu_node_hooks.py [--nodes 64] [--steps 400] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mcore_offload.runtime import native  # noqa: E402

logger = logging.getLogger("cpu_node_hooks")


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad


class Hook:
    """A hook that does what StartHook and CommitHook do besides their handler call: count."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, grad_outputs=None) -> None:
        self.calls += 1


def chain_step(x: torch.Tensor, nodes: int, register: Callable[[torch.Tensor, Hook], object] | None,
               hook: Hook) -> float:
    t0 = time.perf_counter()
    y = x
    for _ in range(nodes):
        y = Scale.apply(y)
        if register is not None:
            register(y, hook)
    y.sum().backward()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=64)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    module = native.build()
    ways = {"python": lambda t, h: t.grad_fn.register_prehook(h), "cpp": module.add_prehook}
    x = torch.randn(16, requires_grad=True)
    hook = Hook()
    added: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(args.steps + args.steps // 10):
        plain = chain_step(x, args.nodes, None, hook)
        for name, register in ways.items():
            t = chain_step(x, args.nodes, register, hook)
            if i >= args.steps // 10:  # warm-up
                added[name].append((t - plain) / args.nodes)
    expected = (args.steps + args.steps // 10) * args.nodes * len(ways)
    if hook.calls != expected:
        raise SystemExit(f"the hooks ran {hook.calls} times, not {expected}: the benchmark measured no hooks")
    result = {name: round(statistics.median(v) * 1e6, 3) for name, v in added.items()}
    for name, us in result.items():
        logger.info("one node hook registered from %s, registration and call: median %.2f us over a plain node", name,
                    us)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"us_per_hook": result, **vars(args), "torch": torch.__version__},
                                                  indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
