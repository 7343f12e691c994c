"""Host time a step spends blocked in reads of device values (``Tensor.cpu``, ``.item``, ``.tolist``).

``pretrain_gpt.py --time-syncs`` wraps those three methods while the schedule runs. A read of a CUDA tensor
returns once the compute stream has reached it (and, if the copy engine is busy, once its small copy got its
turn), so the host time inside is mostly waiting. With ``--alternate-offload``, comparing offloaded with plain
steps shows whether offloading makes the host wait longer at these reads: the MoE token dispatcher reads its
token counts with ``.cpu()`` once per MoE layer and microbatch.

Benchmark tooling only: the library never imports this module.
"""

from __future__ import annotations

import statistics
from time import perf_counter_ns
from typing import Any

import torch

METHODS = ("cpu", "item", "tolist")


class SyncWait:
    """Per-step host time and calls in the wrapped reads of CUDA tensors (``recording`` switches it)."""

    def __init__(self) -> None:
        self.recording = False
        self.step_ns: list[int] = []
        self.step_calls: list[int] = []
        self._ns = 0
        self._calls = 0
        self._saved: dict[str, Any] = {}

    def install(self) -> None:
        for name in METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._wrap(original))

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _wrap(self, original: Any) -> Any:
        def timed(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.recording or not tensor.is_cuda:
                return original(tensor, *args, **kwargs)
            t0 = perf_counter_ns()
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._ns += perf_counter_ns() - t0
                self._calls += 1

        return timed

    def start_step(self) -> None:
        self._ns, self._calls = 0, 0
        self.recording = True

    def end_step(self) -> None:
        self.recording = False
        self.step_ns.append(self._ns)
        self.step_calls.append(self._calls)

    def as_dict(self, on_steps: list[bool] | None = None, first: int = 0) -> dict[str, Any]:
        """Per-step figures; with ``on_steps`` (alternation) the medians of offloaded and plain steps from
        step ``first`` on."""
        ms = [n / 1e6 for n in self.step_ns]
        out: dict[str, Any] = {"per_step_ms": [round(m, 3) for m in ms], "calls_per_step": self.step_calls}
        if on_steps is not None:
            on = [m for m, flag in zip(ms[first:], on_steps[first:]) if flag]
            off = [m for m, flag in zip(ms[first:], on_steps[first:]) if not flag]
            out["on_median_ms"] = statistics.median(on) if on else None
            out["off_median_ms"] = statistics.median(off) if off else None
        return out
