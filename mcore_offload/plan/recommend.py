"""Choose ``offload_modules``: a pure function of per-point bytes, layer compute time and the host link.

The planner feeds it estimates; a runtime ``auto`` mode can feed it bytes the handlers counted and forward
times it measured, with the same :class:`LayerCost` / :class:`RankDemand` values.

Rule: among the valid sets (``attn_proj`` only with ``core_attn``; points that move nothing left out), keep
those whose transfer leaves at most ``max_exposed`` of the layer's compute exposed (see
:mod:`mcore_offload.plan.hardware`). Without a memory target take the one that frees the most bytes; with a
target take the one that frees the fewest bytes that still brings every rank under it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mcore_offload.config import OFFLOAD_MODULES
from mcore_offload.plan.hardware import BACKWARD_FACTOR, LinkSpeed, transfer_timing

MAX_EXPOSED = 0.02


@dataclass(frozen=True)
class LayerCost:
    """One kind of layer: bytes each point would offload (one layer, one microbatch) and its forward time."""

    point_bytes: Mapping[str, int]
    forward_seconds: float

    def set_bytes(self, modules: Sequence[str]) -> int:
        return sum(self.point_bytes.get(m, 0) for m in modules)


@dataclass(frozen=True)
class RankDemand:
    """One rank: how many layers of each kind sit offloaded at its peak, and the bytes it must free
    (``None`` without a memory target; zero or less when it already fits). ``freed``, when given, is the
    peak reduction of each set (keyed by the set of point names), overriding layers x bytes per layer: the
    planner's schedule model (:mod:`mcore_offload.plan.peak`) fills it in."""

    layers_at_peak: Mapping[str, int]
    bytes_to_free: int | None = None
    freed: Mapping[frozenset[str], int] | None = None


@dataclass(frozen=True)
class Recommendation:
    modules: tuple[str, ...]
    exposed_fraction: float
    freed_bytes: tuple[int, ...]  # per rank, in the order of the demands
    meets_target: bool | None  # None without a memory target
    reason: str


def valid_sets(points: Sequence[str], attn_proj_alone: bool = False) -> list[tuple[str, ...]]:
    """Every non-empty set of ``points`` that megatron accepts (``attn_proj`` needs ``core_attn`` unless
    ``attn_proj_alone``: under FP8 the projection saves its own copy, under core_attn recompute the
    checkpoint keeps no output), in the canonical order of
    ``OFFLOAD_MODULES``."""
    names = [m for m in OFFLOAD_MODULES if m in set(points)]
    out = []
    for k in range(1, len(names) + 1):
        for combo in itertools.combinations(names, k):
            if "attn_proj" in combo and "core_attn" not in combo and not attn_proj_alone:
                continue
            out.append(combo)
    return out


def exposed_fraction(modules: Sequence[str], costs: Mapping[str, LayerCost], link: LinkSpeed,
                     backward_factor: float = BACKWARD_FACTOR) -> float:
    """The worst exposed fraction of a layer's compute over the layer kinds."""
    return max((transfer_timing(c.set_bytes(modules), c.forward_seconds, link, backward_factor).exposed_fraction
                for c in costs.values()), default=0.0)


def freed_bytes(modules: Sequence[str], costs: Mapping[str, LayerCost],
                demands: Sequence[RankDemand]) -> tuple[int, ...]:
    """Per rank, the peak reduction: ``freed`` where the demand has it, else offloaded bytes over the layers
    that sit offloaded at its peak."""
    key = frozenset(modules)
    return tuple(d.freed[key] if d.freed is not None and key in d.freed else
                 sum(n * costs[kind].set_bytes(modules) for kind, n in d.layers_at_peak.items() if kind in costs)
                 for d in demands)


def recommend(costs: Mapping[str, LayerCost], link: LinkSpeed, demands: Sequence[RankDemand] = (), *,
              max_exposed: float = MAX_EXPOSED, backward_factor: float = BACKWARD_FACTOR,
              attn_proj_alone: bool = False) -> Recommendation:
    """The recommended set; see the module docstring. ``costs`` maps a layer kind to its :class:`LayerCost`;
    without ``demands`` every kind counts once. ``attn_proj_alone``: see :func:`valid_sets` (FP8, core_attn
    recompute)."""
    if not demands:
        demands = (RankDemand({kind: 1 for kind in costs}),)
    useful = {m for m in OFFLOAD_MODULES if any(c.point_bytes.get(m, 0) > 0 for c in costs.values())}
    if "attn_proj" in useful and not attn_proj_alone:
        useful.add("core_attn")  # attn_proj is only allowed with core_attn, even when core_attn moves nothing
    scored = []
    for modules in valid_sets(sorted(useful), attn_proj_alone):
        if not any(c.set_bytes(modules) for c in costs.values()):
            continue
        scored.append((modules, exposed_fraction(modules, costs, link, backward_factor),
                       freed_bytes(modules, costs, demands)))
    targets = [d.bytes_to_free for d in demands]
    has_target = any(x is not None for x in targets)
    nothing = ((), 0.0, (0,) * len(demands))
    if not scored:
        return _result(nothing, None if not has_target else all((x or 0) <= 0 for x in targets),
                       "no offload point saves anything for this model, layout and recompute setting")
    hidden = [s for s in scored if s[1] <= max_exposed]
    budget = f"{max_exposed:.0%} of compute"
    if not has_target:
        if not hidden:
            return _result(nothing, None, f"every set leaves more than {budget} of the transfer exposed")
        best = max(hidden, key=lambda s: (sum(s[2]), -len(s[0])))
        return _result(best, None, f"the most bytes whose transfer stays hidden (<= {budget} exposed)")
    need = [x or 0 for x in targets]
    if all(x <= 0 for x in need):
        return _result(nothing, True, "every rank fits the memory target without offloading")

    def meets(s: tuple) -> bool:
        return all(f >= n for f, n in zip(s[2], need))

    enough = [s for s in hidden if meets(s)]
    if enough:
        best = min(enough, key=lambda s: (sum(s[2]), len(s[0])))
        return _result(best, True, f"the fewest bytes that meet the memory target with the transfer hidden "
                                   f"(<= {budget} exposed)")
    exposed_enough = [s for s in scored if meets(s)]
    if exposed_enough:
        best = min(exposed_enough, key=lambda s: (s[1], sum(s[2])))
        return _result(best, True, f"meets the memory target, but only with {best[1]:.1%} of compute exposed "
                                   "(no hidden set is enough; copies that trail the forward lower the peak by "
                                   "less than projected)")
    pool = hidden or scored
    best = max(pool, key=lambda s: (sum(s[2]), -s[1]))
    return _result(best, False, "no set reaches the memory target; this one frees the most"
                   + (" while staying hidden" if hidden else "") + "; add recompute or more model parallelism")


def _result(scored: tuple, meets: bool | None, reason: str) -> Recommendation:
    modules, exposed, freed = scored
    return Recommendation(tuple(modules), exposed, tuple(freed), meets, reason)
