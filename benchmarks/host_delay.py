"""A known amount of host time at every transformer layer, to measure how much of it a step exposes.

``pretrain_gpt.py --host-delay-us FWD BWD`` spins the Python thread for FWD µs at the start of every
``TransformerLayer.forward`` and for BWD µs when the gradient of every layer's output arrives (the start of
that layer's backward, on the autograd thread), in every other step. The paired overhead of the delayed
steps over their plain neighbours, divided by the delay added per step, is the fraction of host time that
step time exposes in forward and in backward: where it is near 1 the step is launch-bound there, and host
work of the offload runtime costs its full time; where it is near 0, the GPU's queue hides it.

The spin holds the GIL, as the runtime's Python does. Benchmark tooling only: the library never imports it.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import torch


def spin(us: float) -> None:
    """Busy-wait ``us`` microseconds on this thread (holding the GIL)."""
    end = perf_counter_ns() + int(us * 1000)
    while perf_counter_ns() < end:
        pass


class LayerHooks:
    """Work at every ``TransformerLayer``'s forward start and at its backward start (when the gradient of its output
    arrives), while ``active``; subclasses set ``fwd`` / ``bwd`` (0: none that way) and do the work in
    :meth:`on_forward` / :meth:`on_backward`. ``calls`` counts both."""

    fwd: float = 0
    bwd: float = 0

    def __init__(self) -> None:
        self.active = False
        self.layers = 0
        self.calls = {"fwd": 0, "bwd": 0}

    def install(self, chunks: list[torch.nn.Module], skip_last: bool = False) -> int:
        """Hook every transformer layer of ``chunks`` (``skip_last``: but each chunk's last); returns how many."""
        for chunk in chunks:
            layers = [m for m in chunk.modules() if type(m).__name__ == "TransformerLayer"]
            for module in layers[:-1] if skip_last else layers:
                module.register_forward_pre_hook(self._forward_pre)
                module.register_forward_hook(self._forward_post)
                self.layers += 1
        return self.layers

    def _forward_pre(self, module: Any, args: Any) -> None:
        if self.active and self.fwd and torch.is_grad_enabled():
            self.calls["fwd"] += 1
            self.on_forward()

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, (tuple, list)) else output
        if self.active and self.bwd and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        self.calls["bwd"] += 1
        self.on_backward()

    def on_forward(self) -> None:
        raise NotImplementedError

    def on_backward(self) -> None:
        raise NotImplementedError


class HostDelay(LayerHooks):
    """Spins ``fwd_us`` at every layer's forward and ``bwd_us`` at its backward; ``active`` switches them."""

    def __init__(self, fwd_us: float, bwd_us: float) -> None:
        super().__init__()
        self.fwd_us, self.bwd_us = fwd_us, bwd_us
        self.fwd, self.bwd = fwd_us, bwd_us

    def on_forward(self) -> None:
        spin(self.fwd_us)

    def on_backward(self) -> None:
        spin(self.bwd_us)

    def as_dict(self, delayed_steps: int) -> dict[str, Any]:
        per = max(delayed_steps, 1)
        return {"fwd_us": self.fwd_us, "bwd_us": self.bwd_us, "layers": self.layers,
                "fwd_calls_per_delayed_step": self.calls["fwd"] / per,
                "bwd_calls_per_delayed_step": self.calls["bwd"] / per,
                "delay_ms_per_delayed_step": (self.calls["fwd"] * self.fwd_us + self.calls["bwd"] * self.bwd_us)
                / per / 1e3}
