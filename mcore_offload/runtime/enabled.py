"""Which offload points are on: for a config (its ``offload_modules``, or ``auto``'s candidates less what its recompute
rules out), and only outside a backward (recompute inside backward must not offload)."""

from __future__ import annotations

from typing import Any

import torch

from mcore_offload.config import OFFLOAD_MODULES, recompute_conflicts, selectively_recomputed
from mcore_offload.runtime.auto import AUTO

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """True while the autograd engine runs a backward (recompute inside backward must not offload)."""
    return _graph_task_id is not None and _graph_task_id() != -1


def point_enabled(config: Any, name: str | None) -> bool:
    if name is None or not getattr(config, "fine_grained_activation_offloading", False):
        return False
    modules = config.offload_modules or ()
    if name in modules:
        return True
    if len(modules) == 1 and modules[0].startswith(AUTO):
        # auto may choose any point but those the config's recompute rules out (cached: a hot path)
        excluded = getattr(config, "_mcore_offload_auto_excluded", None)
        if excluded is None:
            excluded = frozenset(recompute_conflicts(selectively_recomputed(config)))
            object.__setattr__(config, "_mcore_offload_auto_excluded", excluded)
        return name not in excluded
    return False


def enabled_points(config: Any) -> frozenset[str]:
    """The offload points :func:`point_enabled` can answer True for under ``config``."""
    return frozenset(name for name in OFFLOAD_MODULES if point_enabled(config, name))


def enabled_points_cached(config: Any) -> frozenset[str]:
    """:func:`enabled_points`, kept on the config per ``offload_modules`` value (one chunk start per microbatch)."""
    key = tuple(config.offload_modules or ())
    cached = getattr(config, "_mcore_offload_enabled_points", None)
    if cached is None or cached[0] != key:
        cached = (key, enabled_points(config))
        object.__setattr__(config, "_mcore_offload_enabled_points", cached)
    return cached[1]
