"""A known cache eviction around every core attention, in every step: does A ``core_attn``'s points' cost come from
what they evict?

Why: on the GPU host the points with nothing moved cost 160-210 µs a layer-microbatch inside A's step (sessions 65
and 67), against 17-24 µs on the host's own CPU in the CPU model (session 73), and under ``perf`` at 4 samples a ms
their step cost fell to −0.49 % [−2.07, 1.81] (session 74). One account fits all three: the points' code and data
push the model's own host working set (its Python, TE's, the dispatcher's, the CUDA driver's) out of the core's
caches, and the launch-bound model code that follows them runs slower. ``perf``'s interrupts would cool those caches
in both kinds of step alike, taking that share away.

``pretrain_gpt.py --evict-core-attn-mib N`` writes N MiB of host memory (one ``memset``, single-threaded, holding
the GIL) at four moments of every layer-microbatch, in offloaded and plain steps alike:

- forward: as the core attention module starts (after the point's block has opened) and as ``linear_proj`` starts
  (after the point's commit);
- backward: as the node that made the core attention's output runs (a pre-hook registered after the point's commit
  hook, so it runs after it) and as the node that made its query input runs (registered after the point's start
  hook).

So the model code after each point starts on caches as cold with the points as without them. If the account holds,
the points' paired cost under eviction falls toward their own host time (about a third of it, session 74); if it
stays where it was, the points' cost is their own work and not what they evict. PyTorch runs a node's C++
pre-hooks in the order they were added and its Python pre-hooks together, at the place of the first Python one:
the evictions (Python, added after ours) run after the points' C++ hooks unless a Python pre-hook sat on that node
before ours (tests/test_cache_evict.py).

``--core-attn-spin-us U`` is the control: at the same four moments it spins U µs (set U to what a write took, the
JSON's ``evict_us_mean``) and writes nothing. It adds the same host time to every step without cooling the caches:
if the points' cost falls under eviction but not under the spin, the caches are the cause, not a step made longer.
Benchmark tooling only: the library never imports it.
"""

from __future__ import annotations

import ctypes
from time import perf_counter_ns
from typing import Any

import torch
from host_delay import spin


class CoreAttnEvict:
    """Writes ``mib`` MiB (or spins ``spin_us`` µs) at the four moments of the module docstring, in every step."""

    def __init__(self, mib: float = 0.0, spin_us: float = 0.0) -> None:
        if bool(mib) == bool(spin_us):
            raise ValueError("CoreAttnEvict takes either mib or spin_us")
        self.spin_ns = int(spin_us * 1000)
        self.nbytes = int(mib * 2**20)
        # plain host memory, touched once here so that the first eviction does not fault pages in
        self.buffer = torch.ones(max(self.nbytes, 1), dtype=torch.uint8)
        self.address = self.buffer.data_ptr()
        self.calls = {"fwd": 0, "bwd": 0}
        self.ns = 0
        self.modules = 0
        self._value = 0

    def evict(self) -> None:
        t0 = perf_counter_ns()
        if self.spin_ns:
            spin(self.spin_ns / 1000)
        else:
            self._value = (self._value + 1) & 0xFF  # a new value each time: every line is written, not skipped
            ctypes.memset(self.address, self._value, self.nbytes)
        self.ns += perf_counter_ns() - t0

    def install(self, chunks: list[torch.nn.Module]) -> int:
        """Hook the core attention and ``linear_proj`` of every attention module of ``chunks``; returns how many."""
        for chunk in chunks:
            for module in chunk.modules():
                core, proj = getattr(module, "core_attention", None), getattr(module, "linear_proj", None)
                if isinstance(core, torch.nn.Module) and isinstance(proj, torch.nn.Module):
                    core.register_forward_pre_hook(self._at_forward)
                    proj.register_forward_pre_hook(self._at_forward)
                    self.modules += 1
        if not self.modules:
            raise SystemExit("--evict-core-attn-mib / --core-attn-spin-us found no attention module with "
                             "core_attention and linear_proj")
        return self.modules

    def _at_forward(self, module: Any, args: tuple) -> None:
        if not torch.is_grad_enabled():
            return
        self.calls["fwd"] += 1
        self.evict()
        first = args[0] if args else None
        node = getattr(first, "grad_fn", None)
        if node is not None:  # after the point's own hook on this node (the module docstring says when it runs)
            node.register_prehook(self._at_backward)

    def _at_backward(self, grad_outputs: Any) -> None:
        self.calls["bwd"] += 1
        self.evict()

    def as_dict(self, steps: int) -> dict[str, Any]:
        per = max(steps, 1)
        calls = self.calls["fwd"] + self.calls["bwd"]
        return {"mib": self.nbytes / 2**20, "spin_us": self.spin_ns / 1000, "attention_modules": self.modules,
                "fwd_calls_per_step": self.calls["fwd"] / per, "bwd_calls_per_step": self.calls["bwd"] / per,
                "evict_ms_per_step": self.ns / 1e6 / per, "evict_us_mean": self.ns / 1e3 / max(calls, 1)}
