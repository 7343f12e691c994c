"""``offload_modules=["auto"]``: choose, per chunk and layer, what to offload so that the copies stay hidden.

Spelling: ``["auto"]`` keeps every copy hidden; ``["auto:<GiB>"]`` (``"auto:38.5"``) offloads just enough to
bring this rank's peak allocated memory to that many GiB, preferring hidden copies.

How: the first :data:`PROBE_STEPS` training steps offload every point (so the probe itself cannot run out
of memory). The second (the *measured* step) times each layer's forward on the compute stream (timing
events at layer boundaries: real time on the GPU's timeline, launch gaps included, which is the window the
copy engine has) and counts the bytes each point's storages take per layer, the D2H throughput the link achieved
and the runtime's host time. The third (the *peak* step, on a GPU) finds the step's peak and the bytes of each
(chunk, layer, point) that were off the device at that moment (a unit that was back on the device then saves
nothing: under pipeline parallelism, a chunk's last layer). That takes an allocator statistics read at every
release and reload, host time that would inflate the measured step's host time and exposure (on A it tripled the
host time per group and the plan chose nothing), so the two never share a step. At the end of the peak step
:func:`choose` picks the units (a point, or core_attn with attn_proj, which share attention's output)
greedily, most peak bytes first, keeping each one only if a simulated copy queue still finishes every layer's
copies before the layer after next starts. Steps after that offload the chosen (chunk, layer, point) only. The
plan is logged once per rank.

Host time is a cost too. Where the step is launch-bound (the GPU has caught up with the host: at a layer's
start the previous layer's start mark has already run on the GPU), every microsecond the runtime spends on
the host is step time (measured: ``benchmarks/host_delay.py``). The probe step measures that share (the
*exposure*) and the runtime's host time per group; the choice then spends at most :data:`HOST_BUDGET` of the
step on exposed host time, preferring the units with the most bytes per exposed host millisecond.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

AUTO = "auto"
#: Steps that offload everything: step 0 also autotunes kernels, step 1 is the measured step, step 2 the peak
#: step (see the module docstring); the plan starts with step 3.
PROBE_STEPS = 3
#: Offload points planned together: attn_proj saves a view of core attention's output (one storage).
UNITS: tuple[tuple[str, ...], ...] = (
    ("attn_norm",), ("qkv_linear",), ("core_attn", "attn_proj"), ("mlp_norm",), ("expert_fc1",), ("moe_act",),
)
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
#: Units whose points chain into one group when both are chosen in a layer (runtime/points.py, CHAIN_NEXT).
FAMILY: dict[tuple[str, ...], str] = {("qkv_linear",): "attention", ("core_attn", "attn_proj"): "attention",
                                      ("expert_fc1",): "experts", ("moe_act",): "experts"}


def parse_auto(modules: Any) -> float | None | bool:
    """``False`` when ``modules`` is not an auto request; else the target in GiB or ``None``.

    Raises ``ValueError`` with the accepted spelling on a malformed request.
    """
    names = list(modules or [])
    autos = [m for m in names if isinstance(m, str) and (m == AUTO or m.startswith(AUTO + ":"))]
    if not autos:
        return False
    if len(names) != 1:
        raise ValueError(
            f"offload_modules={names!r} mixes 'auto' with other names; use ['auto'] (every copy hidden) or "
            "['auto:<GiB>'] (a per-rank peak target, e.g. ['auto:38.5']) alone, or list the points yourself."
        )
    spec = autos[0]
    if spec == AUTO:
        return None
    try:
        gib = float(spec.split(":", 1)[1])
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise ValueError(f"offload_modules entry {spec!r} is not 'auto:<GiB>' with a positive number; "
                         "write e.g. 'auto:38.5'.")
    return gib


def unit_of(point: str) -> tuple[str, ...]:
    return next(u for u in UNITS if point in u)


class ChunkMarks:
    """Clock marks of one chunk's forward in the measured step: each layer's start, and the forward's end.

    ``checks`` / ``caught_up``: layer starts at which the previous layer's start mark was looked at, and how many
    times the GPU had already reached it (the host was less than a layer ahead: launch-bound there). On the H100
    this share matched the measured exposure (B: 0.25 against 0.25 from the attention set's overhead over its host
    time; A and C: ~1). A narrower test (a mark at a flush's start, checked at its end) read 0.50 on A and 0.01 on
    B: in a launch-bound step a queue that is not yet empty still runs dry later, so it is no test.
    """

    __slots__ = ("vp_stage", "layers", "end", "checks", "caught_up")

    def __init__(self, vp_stage: Any) -> None:
        self.vp_stage = vp_stage
        self.layers: list[Any] = []
        self.end: Any = None
        self.checks = 0
        self.caught_up = 0

    def layer_started(self, mark: Any) -> None:
        """A layer starts (``mark``: its clock mark): note whether the device already ran the previous start."""
        if self.layers:
            done = reached(self.layers[-1])
            if done is not None:
                self.checks += 1
                self.caught_up += done
        self.layers.append(mark)


def reached(mark: Any) -> bool | None:
    """Whether the device has run past ``mark`` (a CUDA event: a query, no wait); None for a host clock."""
    return None if isinstance(mark, float) else bool(mark.query())

def clock_mark(device: Any) -> Any:
    """A point in time on the device's timeline: a recorded timing event on CUDA, the host clock on CPU."""
    import torch

    if device is not None and device.type == "cuda":
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def elapsed_ms(a: Any, b: Any) -> float:
    """Milliseconds between two :func:`clock_mark` values (waits for a CUDA event; between steps only)."""
    if isinstance(a, float):
        return (b - a) * 1e3
    b.synchronize()
    return a.elapsed_time(b)


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

    def unit_ms(self, vp: Any, unit: tuple[str, ...], joined: bool) -> float:
        """Exposed host time per step of offloading ``unit`` in one layer of chunk ``vp``."""
        share = JOINED_UNIT_COST if joined and self.chaining else 1.0
        return self.exposure * self.group_ms * share * self.microbatches.get(vp, 1)


def _family(unit: tuple[str, ...]) -> str:
    return FAMILY.get(unit, unit[0])


def host_cost(runtime_ms: float, wall_ms: float, exposure: float | None, microbatches: dict[Any, int],
              unit_layers: dict[Any, set[tuple[int, tuple[str, ...]]]], chaining: bool = True) -> HostCost | None:
    """The probe's host figures as a :class:`HostCost` (None where no exposure could be measured: the CPU).

    ``unit_layers``: per chunk, the (layer, unit) the probe offloaded or kept; the probe's host time is shared
    out over them as groups (a unit joining its family's group in the same layer counts JOINED_UNIT_COST).
    """
    if exposure is None:
        return None
    groups = 0.0
    for vp, units in unit_layers.items():
        per_layer: dict[tuple[int, str], int] = defaultdict(int)
        for layer, unit in units:
            per_layer[(layer, _family(unit) if chaining else unit[0])] += 1
        groups += microbatches.get(vp, 1) * sum(1 + JOINED_UNIT_COST * (n - 1) if chaining else n
                                                for n in per_layer.values())
    group_ms = runtime_ms / groups if groups else 0.0
    plain_ms = max(wall_ms - exposure * runtime_ms, 0.0)
    return HostCost(exposure, group_ms, HOST_BUDGET * plain_ms, dict(microbatches), chaining)


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

    def enabled(self, vp_stage: Any, layer: int, point: str) -> bool:
        return point in self.points.get((vp_stage, layer), ())

    def describe(self) -> str:
        by_chunk: dict[Any, list[str]] = defaultdict(list)
        for (vp, layer), pts in sorted(self.points.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            if pts:
                by_chunk[vp].append(f"L{layer}:{'+'.join(sorted(pts))}")
        chunks = "; ".join(f"chunk {vp}: {' '.join(v)}" for vp, v in by_chunk.items()) or "nothing"
        host = "" if self.host is None else (
            f", host time {self.host_ms:.1f} of {self.host.budget_ms:.1f} ms/step budget (exposure "
            f"{self.host.exposure:.2f}, {self.host.group_ms:.2f} ms per group)")
        return (f"{chunks} | expected peak saving {self.expected_saving_bytes / 2**30:.2f} GiB, link "
                f"{self.link_GBps:.1f} GB/s{host}, copies {'hidden' if self.hidden else 'partly exposed'}"
                + (f" ({self.note})" if self.note else ""))


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
    seen: set[tuple[Any, int, str]] = set()
    total = _kept_ms(host, profiles)
    for _, vp, layer, unit in picked:
        key = (vp, layer, _family(unit))
        total += host.unit_ms(vp, unit, joined=key in seen)
        seen.add(key)
    return total


def _kept_ms(host: HostCost, profiles: dict[Any, ChunkProfile]) -> float:
    """A kept unit's group never copies, but its nodes and hooks run (they start the first prefetch)."""
    return sum(host.unit_ms(vp, unit, joined=True) for vp, p in profiles.items() for _, unit in p.kept)


def choose(profiles: dict[Any, ChunkProfile], link_GBps: float, need_bytes: int | None = None,
           host: HostCost | None = None) -> Plan:
    """Pick units per (chunk, layer); see the module docstring. ``need_bytes``: the peak saving to reach;
    ``host``: the probe's host-time model (None: host time is not counted, as on the CPU)."""
    rate = link_GBps * LINK_MARGIN * 1e6  # bytes per ms
    # A unit that was back on the device (or not yet off it) when the probe's peak was reached saves nothing
    # there: under pipeline parallelism, a chunk's last layer, reloaded as its backward starts.
    remaining = [(nbytes, vp, layer, unit) for vp, p in profiles.items()
                 for (layer, unit), nbytes in p.unit_bytes.items() if nbytes > 0 and p.saving(layer, unit, nbytes) > 0]
    chosen: dict[Any, dict[int, int]] = {vp: {} for vp in profiles}
    families: set[tuple[Any, int, str]] = set()
    picked: list[tuple[int, Any, int, tuple[str, ...]]] = []
    exposed: list[tuple[int, Any, int, tuple[str, ...]]] = []

    def cost(item: tuple) -> float:
        _, vp, layer, unit = item
        return 0.0 if host is None else host.unit_ms(vp, unit, joined=(vp, layer, _family(unit)) in families)

    def value(item: tuple) -> int:
        nbytes, vp, layer, unit = item
        return profiles[vp].saving(layer, unit, nbytes)

    def rank(item: tuple) -> tuple:
        # most peak bytes per exposed host ms first; then the larger saving; then the later layer (next to the
        # chunk's turnaround, so that each chosen layer's backward prefetches the one before it)
        c, v = cost(item), value(item)
        return (v / c if c > 0 else float("inf"), v, item[2], str(item[1]))

    spent = 0.0 if host is None else _kept_ms(host, profiles)  # the first pick brings the kept units along
    while remaining:
        item = max(remaining, key=rank)
        remaining.remove(item)
        nbytes, vp, layer, unit = item
        trial = dict(chosen[vp])
        trial[layer] = trial.get(layer, 0) + nbytes
        c = cost(item)
        if (host is None or spent + c <= host.budget_ms) and _finish_times(profiles[vp], trial, rate):
            chosen[vp] = trial
            picked.append(item)
            families.add((vp, layer, _family(unit)))
            spent += c
        else:
            exposed.append(item)

    def saving(sel: list) -> int:
        return sum(map(value, sel))

    hidden, note = True, ""
    if not picked and not exposed and any(p.unit_bytes for p in profiles.values()):
        note = ("no offloaded group was off the device when the probe reached its peak: offloading would not "
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
    if picked:
        for vp, p in profiles.items():
            for layer, unit in p.kept:
                points[(vp, layer)].update(unit)
    return Plan({k: frozenset(v) for k, v in points.items()}, saving(picked), hidden, link_GBps, note, host,
                _host_ms(host, picked, profiles))


class AutoPlanner:
    """Per-process state of an auto run: probing, then a fixed plan (one per manager; reset with it)."""

    def __init__(self, target_gib: float | None) -> None:
        self.target_gib = target_gib
        self.steps = 0
        self.plan: Plan | None = None
        self._marks: list[ChunkMarks] = []  # the measured step's handlers
        # chunk -> (layer, unit) -> microbatch -> bytes offloaded in the measured step
        self._bytes: dict[Any, dict[tuple[int, tuple[str, ...]], dict[int, int]]] = defaultdict(
            lambda: defaultdict(lambda: defaultdict(int)))
        self._probe_t0: float | None = None  # host clock at the measured step's first chunk start
        self._live_at_peak: dict[Any, int] = {}
        self._kept: dict[Any, set[tuple[int, tuple[str, ...]]]] = defaultdict(set)
        self._peak_seen = -1
        # the measured step's (profiles, host cost, link GB/s), kept for the plan at the peak step's end
        self._measured: tuple[dict[Any, ChunkProfile], HostCost | None, float] | None = None

    @property
    def measuring(self) -> bool:
        """The current step is the measured one: layer clocks, bytes, link throughput, host time."""
        return self.plan is None and self.steps == PROBE_STEPS - 2

    @property
    def tracing_peak(self) -> bool:
        """The current step is the peak step: the peak and what was off the device then (GPU only)."""
        return self.plan is None and self.steps == PROBE_STEPS - 1

    def enabled(self, vp_stage: Any, layer: int, point: str) -> bool:
        return self.plan is None or self.plan.enabled(vp_stage, layer, point)

    # -------------------------------------------------------------------- measurements (probe step)
    def chunk_started(self, vp_stage: Any) -> ChunkMarks | None:
        if not self.measuring:
            return None
        if self._probe_t0 is None:
            self._probe_t0 = time.perf_counter()
        marks = ChunkMarks(vp_stage)
        self._marks.append(marks)
        return marks

    def offloaded(self, vp_stage: Any, microbatch: int, layer: int, point: str, nbytes: int) -> None:
        """One storage of ``point`` left the device in the measured step (a unit's bytes: the sum per microbatch)."""
        if self.measuring:
            self._bytes[vp_stage][(layer, unit_of(point))][microbatch] += nbytes

    def kept(self, vp_stage: Any, layer: int, point: str) -> None:
        if self.measuring:
            self._kept[vp_stage].add((layer, unit_of(point)))

    def peak_check(self, peak: int, live: dict[Any, int]) -> None:
        """The allocator's peak and the chunk forwards in flight per ``vp_stage``, at each layer start of the
        peak step (the peak statistic was reset when that step began)."""
        if self.tracing_peak and peak > self._peak_seen:
            self._peak_seen = peak
            self._live_at_peak = dict(live)

    def step_aborted(self) -> None:
        """A step failed part-way: drop what it measured or traced, so the next step probes afresh. Kept, the
        measured step's bytes would be summed into the next one's per microbatch, and its host clock would start
        at the failed step's first chunk."""
        if self.plan is not None:
            return
        self._marks.clear()
        self._bytes.clear()
        self._kept.clear()
        self._probe_t0 = None
        if self.tracing_peak:
            self._live_at_peak, self._peak_seen = {}, -1

    # ----------------------------------------------------------------------------------- planning
    def step_ended(self, elapsed: Any, link_GBps: float | None, peak_bytes: int | None,
                   off_device_at_peak: int, runtime_ms: float = 0.0, chaining: bool = True,
                   off_at_peak: dict[tuple[Any, int, str], int] | None = None) -> Plan | None:
        """End of a training step. At the end of the measured step, keep its measurements (``elapsed_ms(a, b)``
        reads marks; ``link_GBps``; ``runtime_ms``: the runtime's host time in the step); at the end of the peak
        step, build the plan (``peak_bytes``, ``off_device_at_peak``; ``off_at_peak``: (vp_stage, layer, point) ->
        bytes off the device when the step's peak was reached, None where it was not traced)."""
        was_measuring = self.measuring
        self.steps += 1
        if self.plan is not None:
            return None
        if was_measuring:
            self._measured_step(elapsed, link_GBps, runtime_ms, chaining)
            return None
        if self.steps < PROBE_STEPS or self._measured is None:
            return None
        profiles, host, link = self._measured
        # A probe whose peak came with nothing off the device peaked elsewhere (B on the H100: with every point
        # offloaded, the step peaks while the first backward allocates the gradients). A smaller plan moves the
        # peak back to where activations are held, so the trace says nothing about the units: rank them by bytes.
        untraced_peak = off_at_peak is not None and not any(off_at_peak.values())
        if off_at_peak is not None and not untraced_peak:
            for prof in profiles.values():
                prof.peak_bytes = {}
            for (vp, layer, point), nbytes in off_at_peak.items():
                if vp in profiles:
                    key = (layer, unit_of(point))
                    profiles[vp].peak_bytes[key] = profiles[vp].peak_bytes.get(key, 0) + nbytes
        for vp, prof in profiles.items():
            prof.live_at_peak = max(1, self._live_at_peak.get(vp, 1))
        need = None
        if self.target_gib is not None and peak_bytes is not None:
            # The probe offloaded everything: without offloading the peak would be higher by what was off.
            need = peak_bytes + off_device_at_peak - int(self.target_gib * 2**30)
        self.plan = choose(profiles, link, need, host)
        if untraced_peak:
            self.plan.note = "; ".join(filter(None, [self.plan.note, "ranked by bytes: the probe peaked with nothing "
                                                    "off the device"]))
        logger.info("offload auto plan%s: %s", "" if self.target_gib is None else f" (target {self.target_gib} GiB)",
                    self.plan.describe())
        self._measured = None
        return self.plan

    def _measured_step(self, elapsed: Any, link_GBps: float | None, runtime_ms: float, chaining: bool) -> None:
        """Read the measured step's clocks and keep what the plan needs."""
        wall_ms = (time.perf_counter() - self._probe_t0) * 1e3 if self._probe_t0 is not None else 0.0
        profiles = self._profiles(elapsed)
        checks = sum(m.checks for m in self._marks)
        exposure = sum(m.caught_up for m in self._marks) / checks if checks else None
        microbatches: dict[Any, int] = defaultdict(int)
        for m in self._marks:
            microbatches[m.vp_stage] += 1
        units = {vp: set(p.unit_bytes) | p.kept for vp, p in profiles.items()}
        host = host_cost(runtime_ms, wall_ms, exposure, microbatches, units, chaining)
        self._measured = (profiles, host, link_GBps or 1.0)
        self._marks.clear()

    def _profiles(self, elapsed: Any) -> dict[Any, ChunkProfile]:
        per_layer: dict[Any, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        tails: dict[Any, list[float]] = defaultdict(list)
        for m in self._marks:
            vp, layers = m.vp_stage, m.layers
            for i in range(len(layers) - 1):
                per_layer[vp][i + 1].append(elapsed(layers[i], layers[i + 1]))
            if layers and m.end is not None:
                tails[vp].append(elapsed(layers[-1], m.end))
        out: dict[Any, ChunkProfile] = {}
        for vp in set(per_layer) | set(self._bytes) | set(self._kept):
            prof = ChunkProfile()
            prof.layer_ms = {layer: statistics.median(v) for layer, v in per_layer[vp].items()}
            last = max(prof.layer_ms, default=0) + 1
            if tails[vp]:
                prof.layer_ms[last] = 0.0  # the last layer's time is inside the tail
                prof.tail_ms = statistics.median(tails[vp])
            prof.unit_bytes = {k: int(statistics.median(v.values())) for k, v in self._bytes[vp].items()}
            prof.kept = set(self._kept[vp])
            out[vp] = prof
        return out
