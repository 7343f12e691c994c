"""Burst sizes and the prefetch moment, read from the environment once per manager.

Why a module of their own: the manager, its tests and the copy-out probe (``host_ahead.py``, which changes
``OffloadManager.flush_layers`` at run time) all start from these defaults; keeping them apart from the manager's step
logic says where a default lives and keeps ``manager.py`` about the step.
"""

from __future__ import annotations

from mcore_offload.config import choice_env, positive_int_env

#: layers whose groups leave the device in one copy burst (``MCORE_OFFLOAD_FLUSH_LAYERS``; see
#: OffloadManager.layer_boundary)
DEFAULT_FLUSH_LAYERS = 2

#: layers whose groups come back in one reload burst (``MCORE_OFFLOAD_RELOAD_LAYERS``; see
#: prefetch.Prefetch._prefetch). 1: on the H100, 2 saved 2.8 ms of host time per step on A's attention set but
#: raised C all-five's peak by 76 MiB (session 14)
DEFAULT_RELOAD_LAYERS = 1

#: when backward starts reloading the layer below (``MCORE_OFFLOAD_PREFETCH``; see prefetch.Prefetch._late)
DEFAULT_PREFETCH = "tail"
PREFETCH_CHOICES = ("layer", "tail", "late")


def flush_layers_from_env() -> int:
    """``MCORE_OFFLOAD_FLUSH_LAYERS`` as a positive int (a bad value: one clear sentence)."""
    return positive_int_env("MCORE_OFFLOAD_FLUSH_LAYERS", DEFAULT_FLUSH_LAYERS,
                            "set it to 1 to copy each layer's groups out at the next layer's start, or N to copy "
                            "N layers' groups at once")


def reload_layers_from_env() -> int:
    """``MCORE_OFFLOAD_RELOAD_LAYERS`` as a positive int (a bad value: one clear sentence)."""
    return positive_int_env("MCORE_OFFLOAD_RELOAD_LAYERS", DEFAULT_RELOAD_LAYERS,
                            "set it to 1 to reload one layer ahead of backward, or N to reload N layers at once")


def prefetch_from_env() -> str:
    """``MCORE_OFFLOAD_PREFETCH``: one of :data:`PREFETCH_CHOICES` (another value: one clear sentence)."""
    return choice_env("MCORE_OFFLOAD_PREFETCH", DEFAULT_PREFETCH, PREFETCH_CHOICES)
