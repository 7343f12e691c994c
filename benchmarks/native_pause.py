"""``--alternate-offload`` for upstream's native offloading (megatron-core 0.16): the plain steps (every odd one, or
two in three with ``--alternate-period 3``) run with it off.

The acceptance lines compare our overhead with native's. Separate processes on the GPU host differ by more than
that comparison resolves (two runs of one baseline a minute apart: up to 25 %), so both implementations are timed
the same way: offloaded and plain steps alternating in one process (``paired_steps.py``).

Native decides at two levels, both read at run time:

- each module's ``offload_<point>`` attribute, set once in its constructor from the config (attention, transformer
  layer, experts): every native call site is gated by it;
- ``config.fine_grained_activation_offloading``: ``GPTModel.forward`` creates the chunk handler and the schedules
  reset native's manager only when it is set.

A paused step sets both to False, so none of native's code runs in it: it is a plain megatron-core 0.16 step. The
schedule reset native's manager at the end of the offloaded step before, and native's first step (its warm-up,
whose chunk list it caches) is an offloaded one, so the next offloaded step finds the state it left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# Every per-module switch megatron-core 0.16.1 reads (transformer_layer.py, attention.py, moe/experts.py).
NATIVE_MODULE_SWITCHES = ("offload_attn_norm", "offload_mlp_norm", "offload_qkv_linear", "offload_core_attention",
                          "offload_attn_proj", "offload_expert_fc1", "offload_moe_act")


class NativePause:
    """Turns native offloading off for the steps run inside :meth:`paused`, and back on after."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self.switches: list[tuple[torch.nn.Module, str]] = [
            (m, name) for c in chunks for m in c.modules() for name in NATIVE_MODULE_SWITCHES
            if getattr(m, name, None) is True]
        configs: dict[int, Any] = {}
        for c in chunks:
            for m in c.modules():
                cfg = getattr(m, "config", None)
                if getattr(cfg, "fine_grained_activation_offloading", False) is True:
                    configs[id(cfg)] = cfg
        self.configs = list(configs.values())
        if not self.switches or not self.configs:
            raise ValueError("--alternate-offload on megatron-core 0.16 found no module with native offloading "
                             "switched on: pass --fine-grained-activation-offloading with --offload-modules that the "
                             "model has")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run the block as a plain step: every switch off, restored (on) afterwards, also if it raises."""
        for m, name in self.switches:
            setattr(m, name, False)
        for cfg in self.configs:
            cfg.fine_grained_activation_offloading = False
        try:
            yield
        finally:
            for m, name in self.switches:
                setattr(m, name, True)
            for cfg in self.configs:
                cfg.fine_grained_activation_offloading = True
