"""The choice behind ``offload_modules=["auto"]``: from what the probe steps measured (:class:`ChunkProfile`,
:class:`HostCost`), pick the (chunk, layer, unit) to offload (:func:`choose`) and hold the result (:class:`Plan`).

Pure functions of the measurements, with no clocks and no CUDA: the CPU tests drive them with synthetic profiles.
How the measurements are taken, and when the plan starts, is :mod:`mcore_offload.runtime.auto`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from mcore_offload.runtime.peak_trace import PeakFollower, PeakTrace

#: Share of the measured link throughput the plan may use (the rest absorbs jitter).
LINK_MARGIN = 0.9
#: A memory target is met with this much to spare (the estimate of the peak is not exact).
TARGET_MARGIN = 1.05
#: Share of the plain step that exposed host time of the chosen groups may take (the issue's 2 % less the
#: per-step costs every offloading step pays: chunk starts, the step end, points that stay off).
HOST_BUDGET = 0.015
#: Host time of a unit that joins a group already open in its layer (a chain, runtime/points.py), relative to
#: a group of its own: its saved tensors and storages cost, the group's nodes, events and bursts do not
#: (measured on A: core_attn 0.52 ms per group, the chained attention set 0.74 ms).
JOINED_UNIT_COST = 0.4
#: Host time a group costs outside the runtime's clock, relative to what the clock sees: PyTorch's dispatch of the
#: saved-tensor and node hooks and of the autograd calls around them, which no clock of ours can hold. The points with
#: nothing moved cost about as much as the clock reads with the bytes: A `core_attn` +2.83 % pooled (about 11 ms a
#: step) against a clock of 13 ms, C experts +2.01 % (about 14 ms) against 8-9 ms (1x H200, sessions 65-67); on the
#: CPU the clock saw about half of the runtime's cost (session 41). With the clock alone, `auto`'s plans on A and C
#: were expected to cost 1.3-1.5 % of the step and measured +2.30 % and +2.88 % (three calls each, sessions 66-67).
OUTSIDE_CLOCK = 1.0
#: Share of the plain step that moving 1 GiB out and back in a step costs by itself where the step is launch-bound
#: (exposure 1), beyond the runtime's own host time: the host thread runs slower while reloads stream in, whoever
#: issues them. The link traffic alone (no runtime; the load's own copy calls included) measured 0.8-1.5 % per GiB
#: on the H100 host (sessions 16-17: A core_attn, A attention set, C experts, C all five); on C the runtime's host
#: time alone explained 40 % of all five's overhead and the plan overshot the 2 % (session 16). On the 2x H200 host
#: 1.0-1.7 % per GiB (sessions 50, 53, 54: D-dense 2.25 and 3.0 GiB, A 2.81 GiB; each interval about +-1 % of the
#: step), the load's own copy calls included (on D-dense about 0.3 % per GiB: 5.5 ms of host time a step for 3 GiB);
#: without them about 0.7-1.3 %. The runtime's host time already holds its own copy calls: counting them here too errs
#: toward offloading less.
TRAFFIC_SHARE_PER_GIB = 0.01
#: A layer's point -> the point whose group it continues when both are on (runtime/saved.py's CHAIN_NEXT read
#: backwards; tests/test_auto_units.py checks the two agree). Only neighbours chain: with core_attn off, qkv_linear and
#: attn_proj (a pair auto may pick under FP8) open a group each.
CHAIN_PREVIOUS: dict[str, str] = {"core_attn": "qkv_linear", "attn_proj": "core_attn", "moe_act": "expert_fc1"}


def joins_a_group(unit: tuple[str, ...], chosen: set[str] | frozenset[str]) -> bool:
    """Whether ``unit`` would join a group of the points ``chosen`` in its layer instead of opening one."""
    return any(CHAIN_PREVIOUS.get(p) in chosen or any(CHAIN_PREVIOUS.get(q) == p for q in chosen) for p in unit)


@dataclass
class ChunkProfile:
    """What the probe step measured for one model chunk (``vp_stage``), per layer (1-based)."""

    layer_ms: dict[int, float] = field(default_factory=dict)  # forward time of each layer
    tail_ms: float = 0.0  # from the last layer's start to the chunk's end (last layer + head)
    unit_bytes: dict[tuple[int, tuple[str, ...]], int] = field(default_factory=dict)  # (layer, unit) -> bytes
    live_at_peak: int = 1  # microbatches of this chunk in flight when the probe's peak was reached
    # (layer, unit) whose groups stayed on the device (backward came before any flush: the chunk's last
    # layer at PP=1). They cost no link time, and their backward is what starts the first prefetch.
    kept: set[tuple[int, tuple[str, ...]]] = field(default_factory=set)
    # (layer, unit) -> its bytes off the device when the probe's peak was reached, over all microbatches; None
    # where the peak was not traced (the CPU): then a unit's saving is its bytes times live_at_peak
    peak_bytes: dict[tuple[int, tuple[str, ...]], int] | None = None

    def saving(self, layer: int, unit: tuple[str, ...], nbytes: int) -> int:
        """What offloading ``unit`` in ``layer`` takes off this rank's peak (``nbytes``: one microbatch's)."""
        if self.peak_bytes is None:
            return nbytes * self.live_at_peak
        return self.peak_bytes.get((layer, unit), 0)


@dataclass
class HostCost:
    """What the probe step says about the runtime's host time (see the module docstring)."""

    exposure: float  # share of host time that is step time (1: launch-bound, 0: the GPU's queue hides it)
    group_ms: float  # host time of one group in one microbatch
    budget_ms: float  # exposed host time per step the plan may spend
    microbatches: dict[Any, int]  # forwards per step of each chunk
    chaining: bool = True  # units of one family share a group (MCORE_OFFLOAD_CHAIN_POINTS)
    gib_ms: float = 0.0  # exposed step time per GiB a step moves out and back in (TRAFFIC_SHARE_PER_GIB)
    outside_clock: float = OUTSIDE_CLOCK  # what group_ms adds to the clock's reading, relative to it
    budget_share: float = HOST_BUDGET  # budget_ms as a share of the plain step (records before it: HOST_BUDGET)

    def unit_ms(self, vp: Any, unit: tuple[str, ...], joined: bool, nbytes: int = 0) -> float:
        """Exposed host time per step of offloading ``unit`` in one layer of chunk ``vp`` (``nbytes``: what it moves
        in one microbatch; 0 for a kept unit, which never copies)."""
        share = JOINED_UNIT_COST if joined and self.chaining else 1.0
        mb = self.microbatches.get(vp, 1)
        return self.exposure * self.group_ms * share * mb + self.gib_ms * nbytes * mb / 2**30


def layer_groups(units: list[tuple[str, ...]] | set[tuple[str, ...]], chaining: bool = True) -> float:
    """Group-equivalents of one layer-microbatch offloading ``units``: a group per chain of neighbouring units
    (:func:`joins_a_group`, the runtime's rule), each further unit of a chain counting JOINED_UNIT_COST. Where a
    chain has a gap (core_attn left out under its recompute) qkv_linear and attn_proj are two groups."""
    units = sorted(units)
    if not chaining:
        return float(len(units))
    chains: list[set[str]] = []  # the points of each chain found so far
    for unit in units:
        linked = [c for c in chains if joins_a_group(unit, c)]
        merged = set(unit).union(*linked)
        chains = [c for c in chains if not any(c is m for m in linked)] + [merged]
    return len(chains) + JOINED_UNIT_COST * (len(units) - len(chains))


def host_cost(runtime_ms: float, wall_ms: float, exposure: float | None, microbatches: dict[Any, int],
              unit_layers: dict[Any, set[tuple[int, tuple[str, ...]]]], chaining: bool = True,
              outside_clock: float | None = None, budget_share: float = HOST_BUDGET) -> HostCost | None:
    """The probe's host figures as a :class:`HostCost` (None where no exposure could be measured: the CPU).

    ``unit_layers``: per chunk, the (layer, unit) the probe offloaded or kept; the probe's host time (``runtime_ms``,
    the runtime's clock, and ``outside_clock`` of it more, default :data:`OUTSIDE_CLOCK`) is shared out over them as
    groups (:func:`probe_groups`). ``budget_share``: the share of the plain step the plan may spend on exposed host
    time (default :data:`HOST_BUDGET`).
    """
    if exposure is None:
        return None
    if outside_clock is None:
        outside_clock = OUTSIDE_CLOCK
    groups = probe_groups(microbatches, unit_layers, chaining)
    host_ms = (1.0 + outside_clock) * runtime_ms  # the clock's reading and what it cannot see
    group_ms = host_ms / groups if groups else 0.0
    plain_ms = max(wall_ms - exposure * host_ms, 0.0)
    return HostCost(exposure, group_ms, budget_share * plain_ms, dict(microbatches), chaining,
                    gib_ms=exposure * TRAFFIC_SHARE_PER_GIB * plain_ms, outside_clock=outside_clock,
                    budget_share=budget_share)


def probe_groups(microbatches: dict[Any, int], unit_layers: dict[Any, set[tuple[int, tuple[str, ...]]]],
                 chaining: bool = True) -> float:
    """Group-equivalents of the probe step: :func:`layer_groups` of each chunk's layers, times its microbatches."""
    groups = 0.0
    for vp, units in unit_layers.items():
        per_layer: dict[int, list[tuple[str, ...]]] = defaultdict(list)
        for layer, unit in units:
            per_layer[layer].append(unit)
        groups += microbatches.get(vp, 1) * sum(layer_groups(u, chaining) for u in per_layer.values())
    return groups


@dataclass
class Plan:
    """The chosen (chunk, layer) -> points, and what the choice expects."""

    points: dict[tuple[Any, int], frozenset[str]]
    expected_saving_bytes: int
    hidden: bool  # every chosen copy fits the simulated link (and the host budget)
    link_GBps: float
    note: str = ""
    host: HostCost | None = None  # the host-time model the choice used (None: host time not counted)
    host_ms: float = 0.0  # exposed host time per step the chosen units are expected to cost
    # (chunk, layer) whose units are in ``points`` only because they stay on the device (the chunk turns around there):
    # nothing of theirs moves, and the plan line says so
    kept: frozenset[tuple[Any, int]] = frozenset()

    def enabled(self, vp_stage: Any, layer: int, point: str) -> bool:
        return point in self.points.get((vp_stage, layer), ())

    def describe(self) -> str:
        by_chunk: dict[Any, list[str]] = defaultdict(list)
        for (vp, layer), pts in sorted(self.points.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            if pts:
                where = f"L{layer}(kept on the device)" if (vp, layer) in self.kept else f"L{layer}"
                by_chunk[vp].append(f"{where}:{'+'.join(sorted(pts))}")
        chunks = "; ".join(f"chunk {vp}: {' '.join(v)}" for vp, v in by_chunk.items()) or "nothing"
        host = "" if self.host is None else (
            f", host time {self.host_ms:.1f} of {self.host.budget_ms:.1f} ms/step budget"
            + (f" ({100 * self.host.budget_share:.1f} % of the step)" if self.host.budget_share != HOST_BUDGET else "")
            + f" (exposure "
            f"{self.host.exposure:.2f}, {self.host.group_ms:.2f} ms per group with {self.host.outside_clock:.1f}x the "
            f"clock outside it, {self.host.gib_ms:.1f} ms per GiB moved)")
        # What the model checked, not a measurement: stall_ms can be non-zero under a plan that fits (D-moe at a
        # wide budget, session 72: reloads waiting at the chunks' backward starts), so the line names the model.
        limits = "the modelled link" + ("" if self.host is None else " and host budget")
        fits = f"copies {'within' if self.hidden else 'beyond'} {limits}"
        return (f"{chunks} | expected peak saving {self.expected_saving_bytes / 2**30:.2f} GiB, link "
                f"{self.link_GBps:.1f} GB/s{host}, {fits}" + (f" ({self.note})" if self.note else ""))


def _finish_times(profile: ChunkProfile, chosen: dict[int, int], rate_bpms: float) -> bool:
    """Whether a FIFO copy queue, fed each layer's bytes when the next layer starts, keeps up.

    Layer l's copies may start at the start of layer l+1 and must end by the start of layer l+2 (one
    layer of lag; the last layers against the chunk's end plus one more layer's time).
    """
    layers = sorted(profile.layer_ms)
    starts, t = {}, 0.0
    for layer in layers:
        starts[layer] = t
        t += profile.layer_ms[layer]
    end = t + profile.tail_ms
    # after the chunk's end the last layer's copies get one more layer's time (or the tail's)
    last_ms = profile.tail_ms or (profile.layer_ms[layers[-1]] if layers else 0.0)
    busy_until = 0.0
    for layer in layers:
        nbytes = chosen.get(layer, 0)
        if not nbytes:
            continue
        ready = starts.get(layer + 1, end)
        deadline = starts.get(layer + 2, end if layer + 1 in starts else end + last_ms)
        busy_until = max(busy_until, ready) + nbytes / rate_bpms
        if busy_until > deadline:
            return False
    return True


def _host_ms(host: HostCost | None, picked: list, profiles: dict[Any, ChunkProfile]) -> float:
    """Exposed host time per step of ``picked`` units, with the kept units they bring along."""
    if host is None or not picked:
        return 0.0
    seen: dict[tuple[Any, int], set[str]] = defaultdict(set)
    total = _kept_ms(host, profiles)
    for nbytes, vp, layer, unit in picked:
        total += host.unit_ms(vp, unit, joined=joins_a_group(unit, seen[(vp, layer)]), nbytes=nbytes)
        seen[(vp, layer)].update(unit)
    return total


def _kept_ms(host: HostCost, profiles: dict[Any, ChunkProfile]) -> float:
    """A kept unit's group never copies, but its nodes and hooks run (they start the first prefetch)."""
    return sum(host.unit_ms(vp, unit, joined=True) for vp, p in profiles.items() for _, unit in p.kept)


def choose(profiles: dict[Any, ChunkProfile], link_GBps: float, need_bytes: int | None = None,
           host: HostCost | None = None, trace: PeakTrace | None = None) -> Plan:
    """Pick units per (chunk, layer); see the module docstring. ``need_bytes``: the peak saving to reach;
    ``host``: the probe's host-time model (None: host time is not counted, as on the CPU); ``trace``: the plain
    step's peak per interval, keyed by (chunk, layer, unit) (runtime/peak_trace.py; None: each unit saves
    :meth:`ChunkProfile.saving`, what was off the device at the probe's own peak)."""
    rate = link_GBps * LINK_MARGIN * 1e6  # bytes per ms
    # A unit that was back on the device (or not yet off it) when the peak was reached saves nothing there: under
    # pipeline parallelism, a chunk's last layer, reloaded as its backward starts. With a trace, a unit counts
    # what it holds in the interval that is the highest once the units picked before it are off (the peak moves).
    follower = PeakFollower(trace) if trace is not None else None
    in_trace = trace.keys() if trace is not None else set()
    remaining = [(nbytes, vp, layer, unit) for vp, p in profiles.items()
                 for (layer, unit), nbytes in p.unit_bytes.items()
                 if nbytes > 0 and ((vp, layer, unit) in in_trace if trace is not None
                                    else p.saving(layer, unit, nbytes) > 0)]
    chosen: dict[Any, dict[int, int]] = {vp: {} for vp in profiles}
    on: dict[tuple[Any, int], set[str]] = defaultdict(set)  # the points picked so far per (chunk, layer)
    picked: list[tuple[int, Any, int, tuple[str, ...]]] = []
    exposed: list[tuple[int, Any, int, tuple[str, ...]]] = []

    def cost(item: tuple) -> float:
        nbytes, vp, layer, unit = item
        return 0.0 if host is None else host.unit_ms(vp, unit, joined=joins_a_group(unit, on[(vp, layer)]),
                                                     nbytes=nbytes)

    def value(item: tuple) -> int:
        nbytes, vp, layer, unit = item
        if follower is not None:
            return follower.at_peak((vp, layer, unit))
        return profiles[vp].saving(layer, unit, nbytes)

    def rank(item: tuple) -> tuple:
        # most peak bytes per exposed host ms first; then the larger saving; then the later layer (next to the
        # chunk's turnaround, so that each chosen layer's backward prefetches the one before it)
        c, v = cost(item), value(item)
        return (v / c if c > 0 else float("inf"), v, item[2], str(item[1]))

    spent = 0.0 if host is None else _kept_ms(host, profiles)  # the first pick brings the kept units along
    while remaining:
        item = max(remaining, key=rank)
        if value(item) <= 0:  # traced: no unit left is off the device where the step now peaks
            break
        remaining.remove(item)
        nbytes, vp, layer, unit = item
        trial = dict(chosen[vp])
        trial[layer] = trial.get(layer, 0) + nbytes
        c = cost(item)
        if (host is None or spent + c <= host.budget_ms) and _finish_times(profiles[vp], trial, rate):
            chosen[vp] = trial
            picked.append(item)
            on[(vp, layer)].update(unit)
            spent += c
            if follower is not None:
                follower.take((vp, layer, unit))
        else:
            exposed.append(item)

    def saving(sel: list) -> int:
        if trace is not None:
            return trace.saving((vp, layer, unit) for _, vp, layer, unit in sel)
        return sum(map(value, sel))

    hidden, note = True, ""
    if not picked and not exposed and any(p.unit_bytes for p in profiles.values()):
        note = ("no offloaded group was off the device when the step reached its peak: offloading would not "
                "lower it")
    if need_bytes is not None:
        need = int(need_bytes * TARGET_MARGIN)
        if need <= 0:
            picked, note = [], "the peak is already under the target"
        elif saving(picked) >= need:
            kept: list = []
            for item in picked:  # best first: the cheapest groups that reach the target
                if saving(kept) >= need:
                    break
                kept.append(item)
            picked = kept
        else:
            for item in exposed:
                if saving(picked) >= need:
                    break
                picked.append(item)
                hidden = False
            if saving(picked) < need:
                note = (f"target not reachable: offloading everything saves about "
                        f"{saving(picked) / 2**30:.2f} GiB of the {need_bytes / 2**30:.2f} GiB needed")
    elif host is not None and exposed and not picked:
        note = "no unit fits the host-time budget: the step is launch-bound and offloading would cost step time"
    points: dict[tuple[Any, int], set[str]] = defaultdict(set)
    for _, vp, layer, unit in picked:
        points[(vp, layer)].update(unit)
    moved = set(points)
    if picked:
        for vp, p in profiles.items():
            for layer, unit in p.kept:
                points[(vp, layer)].update(unit)
    return Plan({k: frozenset(v) for k, v in points.items()}, saving(picked), hidden, link_GBps, note, host,
                _host_ms(host, picked, profiles), frozenset(points.keys() - moved))
