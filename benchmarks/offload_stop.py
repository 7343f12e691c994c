"""``pretrain_gpt.py --offload-first-steps K [--offload-from-step S]``: ours offloads in steps S..K-1 only (S defaults
to 0), and every other step runs inside ``mcore_offload.paused()``, optionally after releasing, before step K, state
the offloaded steps left behind.

Why: in the alternating runs of sessions 24 and 25 (D-dense ``core_attn``, 2x H200) the plain steps were about 6 ms
slower than the steps of a run that never offloaded (``--offload-paused``) or had no offloading at all, and no slower
right after an offloaded step than two steps later: a lasting state, not an after-effect. Timing the plain steps
after offloading stopped, with and without releasing each kind of state, says which state it is:

- ``keep``: release nothing (does the slowness outlast offloading?);
- ``empty-cache``: ``torch.cuda.empty_cache()``: the device caching allocator's free segments go back to the driver,
  so later steps lay out their blocks afresh (the offloaded steps freed activations early and allocated reloads);
- ``release-host``: our pinned host buffers and PyTorch's cached pinned blocks are freed;
- ``both``.

With S > 0 the same process has plain steps from before offloading ever ran: their median against the one after the
stop is immune to the drift between processes that made session 25's runs hard to compare.

Benchmark tooling only: the library never imports this module.
"""

from __future__ import annotations

import logging
import statistics

import torch

logger = logging.getLogger(__name__)

RELEASES = ("keep", "empty-cache", "release-host", "both")


def release_after_offloading(what: str) -> None:
    """Release what ``what`` names (one of :data:`RELEASES`), between steps (untimed)."""
    if what not in RELEASES:
        raise ValueError(f"unknown release {what!r}: use one of {', '.join(RELEASES)}")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if what in ("release-host", "both"):
        from mcore_offload.runtime import transport

        for t in transport._TRANSPORTS.values():
            t.synchronize()
            t.pool.clear()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:  # PyTorch's caching host allocator keeps freed pinned blocks otherwise
            empty_host()
    if what in ("empty-cache", "both") and torch.cuda.is_available():
        torch.cuda.empty_cache()
    logger.info("offloading stopped; released: %s", what)


def offload_stop_summary(step_ms: list[float], warmup: int, start: int, stop: int, released: str) -> dict:
    """The JSON's ``offload_stop``: medians of the plain steps before ``start`` (from ``warmup``) and from two after
    ``stop`` (a step or two after a switch may still settle), and the second over the first in percent."""
    before = step_ms[warmup:start]
    after = step_ms[max(stop + 2, warmup):]
    med_before = statistics.median(before) if before else None
    med_after = statistics.median(after) if after else None
    return {"first_offloaded_step": start, "first_plain_step": stop, "released": released,
            "plain_before_ms_median": med_before, "plain_before_steps_counted": len(before),
            "plain_ms_median": med_after, "plain_steps_counted": len(after),
            "after_over_before_pct": None if not (med_before and med_after) else 100 * (med_after / med_before - 1)}
