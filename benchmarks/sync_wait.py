"""Host time a step spends blocked on the device: reads of device values and event / stream synchronisations.

``pretrain_gpt.py --time-syncs`` wraps ``Tensor.cpu``, ``.item``, ``.tolist`` (of CUDA tensors) and
``torch.cuda.Event.synchronize`` / ``Stream.synchronize`` while the schedule runs. Such a call returns once the
device has reached it (and, for a copy, once the copy engine got to its small copy), so the host time inside is
mostly waiting. With ``--alternate-offload``, comparing offloaded with plain steps shows whether offloading makes
the host wait longer there. The MoE token dispatchers read their token counts once per MoE layer and microbatch:
the all-to-all dispatcher copies them on a side stream and then synchronises an event; the all-gather one calls
``.cpu()``.

Benchmark tooling only: the library never imports this module.
"""

from __future__ import annotations

import statistics
from time import perf_counter_ns
from typing import Any

import torch

#: (owner, method, only for CUDA tensors)
TARGETS = ((torch.Tensor, "cpu", True), (torch.Tensor, "item", True), (torch.Tensor, "tolist", True),
           (torch.cuda.Event, "synchronize", False), (torch.cuda.Stream, "synchronize", False))


class SyncWait:
    """Per-step host time and calls in the wrapped methods (``recording`` switches it)."""

    def __init__(self) -> None:
        self.recording = False
        self.step_ns: list[int] = []
        self.step_calls: list[int] = []
        self._ns = 0
        self._calls = 0
        self.by_name_ns: dict[str, int] = {}  # over every recorded step
        self._saved: list[tuple[Any, str, Any, bool]] = []

    def install(self) -> None:
        for owner, name, cuda_only in TARGETS:
            own = name in owner.__dict__  # torch.Tensor inherits .cpu from the C base class
            original = getattr(owner, name)
            self._saved.append((owner, name, original, own))
            setattr(owner, name, self._wrap(original, f"{owner.__name__}.{name}", cuda_only))

    def uninstall(self) -> None:
        for owner, name, original, own in reversed(self._saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._saved.clear()

    def _wrap(self, original: Any, label: str, cuda_only: bool) -> Any:
        def timed(obj: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.recording or (cuda_only and not obj.is_cuda):
                return original(obj, *args, **kwargs)
            t0 = perf_counter_ns()
            try:
                return original(obj, *args, **kwargs)
            finally:
                ns = perf_counter_ns() - t0
                self._ns += ns
                self._calls += 1
                self.by_name_ns[label] = self.by_name_ns.get(label, 0) + ns

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
        out: dict[str, Any] = {"per_step_ms": [round(m, 3) for m in ms], "calls_per_step": self.step_calls,
                               "total_ms_by_call": {k: round(v / 1e6, 3) for k, v in self.by_name_ns.items()}}
        if on_steps is not None:
            on = [m for m, flag in zip(ms[first:], on_steps[first:]) if flag]
            off = [m for m, flag in zip(ms[first:], on_steps[first:]) if not flag]
            out["on_median_ms"] = statistics.median(on) if on else None
            out["off_median_ms"] = statistics.median(off) if off else None
        return out
