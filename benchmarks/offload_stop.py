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

With S > 0 the same process has plain steps from before offloading ever ran. Against them, the plain steps after the
stop say whether the slowness lasts, and the offloaded steps give an overhead against no offloading that neither the
drift between processes (which blurred session 25's runs) nor a lasting state in the alternation's plain steps (which
biases ours' paired overhead) distorts. It works for native on megatron-core 0.16 too (its switches, through
``native_pause.py``), so ``overhead_ratio.py`` can compare two such runs.

Benchmark tooling only: the library never imports this module.
"""

from __future__ import annotations

import logging
import random
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
        from mcore_offload.runtime.transport import release_host_buffers

        release_host_buffers()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:  # PyTorch's caching host allocator keeps freed pinned blocks otherwise
            empty_host()
    if what in ("empty-cache", "both") and torch.cuda.is_available():
        torch.cuda.empty_cache()
    logger.info("offloading stopped; released: %s", what)


def window_steps(step_ms: list[float], warmup: int, start: int, stop: int) -> dict[str, list[float]]:
    """The counted steps of each phase: plain before ``start`` (from ``warmup``), offloaded from two after ``start``
    and plain from two after ``stop`` (a step or two after a switch may still settle; native's first offloaded step
    is its warm-up)."""
    return {"before": step_ms[warmup:start], "offloaded": step_ms[max(start + 2, warmup):stop],
            "after": step_ms[max(stop + 2, warmup):]}


def over_pct(num: list[float], den: list[float]) -> float | None:
    """The median of ``num`` over the median of ``den``, less 1, in percent (None without both)."""
    return 100 * (statistics.median(num) / statistics.median(den) - 1) if num and den else None


def over_pct_interval(num: list[float], den: list[float], rounds: int = 2000, seed: int = 0) -> list[float] | None:
    """A bootstrap 95 % interval of :func:`over_pct`, each phase resampled on its own (fixed seed)."""
    if len(num) < 2 or len(den) < 2:
        return None
    rng = random.Random(seed)
    draws = sorted(over_pct(rng.choices(num, k=len(num)), rng.choices(den, k=len(den))) for _ in range(rounds))
    return [draws[int(0.025 * rounds)], draws[min(int(0.975 * rounds), rounds - 1)]]


def offload_stop_summary(step_ms: list[float], warmup: int, start: int, stop: int, released: str) -> dict:
    """The JSON's ``offload_stop``: each phase's median (:func:`window_steps`), the plain steps after over those before,
    and the offloaded steps over the plain ones before, with its interval: with ``start`` past the warm-up, an
    overhead against steps of the same process in which offloading had never run."""
    phases = window_steps(step_ms, warmup, start, stop)
    before, offloaded, after = phases["before"], phases["offloaded"], phases["after"]
    return {"first_offloaded_step": start, "first_plain_step": stop, "released": released,
            "plain_before_ms_median": statistics.median(before) if before else None,
            "plain_before_steps_counted": len(before),
            "offloaded_ms_median": statistics.median(offloaded) if offloaded else None,
            "offloaded_steps_counted": len(offloaded),
            "plain_ms_median": statistics.median(after) if after else None, "plain_steps_counted": len(after),
            "after_over_before_pct": over_pct(after, before),
            "offloaded_over_before_pct": over_pct(offloaded, before),
            "offloaded_over_before_ci95_pct": over_pct_interval(offloaded, before)}
