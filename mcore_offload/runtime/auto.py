"""``offload_modules=["auto"]``: choose, per chunk and layer, what to offload so that the copies stay hidden.

Spelling: ``["auto"]`` keeps every copy hidden; ``["auto:<GiB>"]`` (``"auto:38.5"``) offloads just enough to
bring this rank's peak allocated memory to that many GiB, preferring hidden copies.

How: the first :data:`PROBE_STEPS` training steps offload every point (so the probe itself cannot run out
of memory) and measure, in the last of them, each layer's forward time on the compute stream (timing
events at layer boundaries: real time on the GPU's timeline, launch gaps included, which is the window the
copy engine has), the bytes each point's storages take per layer, the D2H throughput the link achieved,
and the peak with the bytes that were off the device at that moment. At the end of that step
:func:`choose` picks the units (a point, or core_attn with attn_proj, which share attention's output)
greedily by bytes, keeping each one only if a simulated copy queue still finishes every layer's copies
before the layer after next starts. Steps after that offload the chosen (chunk, layer, point) only.
The plan is logged once per rank.
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
#: Steps that offload everything and measure; step 0 also autotunes kernels, so the last one is measured.
PROBE_STEPS = 2
#: Offload points planned together: attn_proj saves a view of core attention's output (one storage).
UNITS: tuple[tuple[str, ...], ...] = (
    ("attn_norm",), ("qkv_linear",), ("core_attn", "attn_proj"), ("mlp_norm",), ("expert_fc1",), ("moe_act",),
)
#: Share of the measured link throughput the plan may use (the rest absorbs jitter).
LINK_MARGIN = 0.9
#: A memory target is met with this much to spare (the estimate of the peak is not exact).
TARGET_MARGIN = 1.05


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
    """Clock marks of one chunk's forward in the measured step: each layer's start, and the forward's end."""

    __slots__ = ("vp_stage", "layers", "end")

    def __init__(self, vp_stage: Any) -> None:
        self.vp_stage = vp_stage
        self.layers: list[Any] = []
        self.end: Any = None


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


@dataclass
class Plan:
    """The chosen (chunk, layer) -> points, and what the choice expects."""

    points: dict[tuple[Any, int], frozenset[str]]
    expected_saving_bytes: int
    hidden: bool  # every chosen copy fits the simulated link
    link_GBps: float
    note: str = ""

    def enabled(self, vp_stage: Any, layer: int, point: str) -> bool:
        return point in self.points.get((vp_stage, layer), ())

    def describe(self) -> str:
        by_chunk: dict[Any, list[str]] = defaultdict(list)
        for (vp, layer), pts in sorted(self.points.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            if pts:
                by_chunk[vp].append(f"L{layer}:{'+'.join(sorted(pts))}")
        chunks = "; ".join(f"chunk {vp}: {' '.join(v)}" for vp, v in by_chunk.items()) or "nothing"
        return (f"{chunks} | expected peak saving {self.expected_saving_bytes / 2**30:.2f} GiB, link "
                f"{self.link_GBps:.1f} GB/s, copies {'hidden' if self.hidden else 'partly exposed'}"
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


def choose(profiles: dict[Any, ChunkProfile], link_GBps: float, need_bytes: int | None = None) -> Plan:
    """Pick units per (chunk, layer); see the module docstring. ``need_bytes``: the peak saving to reach."""
    rate = link_GBps * LINK_MARGIN * 1e6  # bytes per ms
    items = sorted(((nbytes, vp, layer, unit) for vp, p in profiles.items()
                    for (layer, unit), nbytes in p.unit_bytes.items() if nbytes > 0),
                   key=lambda x: (-x[0], str(x[1]), x[2], x[3]))
    chosen: dict[Any, dict[int, int]] = {vp: {} for vp in profiles}
    picked: list[tuple[int, Any, int, tuple[str, ...]]] = []
    exposed: list[tuple[int, Any, int, tuple[str, ...]]] = []
    for item in items:
        nbytes, vp, layer, _ = item
        trial = dict(chosen[vp])
        trial[layer] = trial.get(layer, 0) + nbytes
        if _finish_times(profiles[vp], trial, rate):
            chosen[vp] = trial
            picked.append(item)
        else:
            exposed.append(item)

    def saving(sel: list) -> int:
        return sum(n * profiles[vp].live_at_peak for n, vp, _, _ in sel)

    hidden, note = True, ""
    if need_bytes is not None:
        need = int(need_bytes * TARGET_MARGIN)
        if need <= 0:
            picked, note = [], "the peak is already under the target"
        elif saving(picked) >= need:
            kept: list = []
            for item in picked:  # largest first: the fewest groups that reach the target
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
    points: dict[tuple[Any, int], set[str]] = defaultdict(set)
    for _, vp, layer, unit in picked:
        points[(vp, layer)].update(unit)
    if picked:
        for vp, p in profiles.items():
            for layer, unit in p.kept:
                points[(vp, layer)].update(unit)
    return Plan({k: frozenset(v) for k, v in points.items()}, saving(picked), hidden, link_GBps, note)


class AutoPlanner:
    """Per-process state of an auto run: probing, then a fixed plan (one per manager; reset with it)."""

    def __init__(self, target_gib: float | None) -> None:
        self.target_gib = target_gib
        self.steps = 0
        self.plan: Plan | None = None
        self._marks: list[ChunkMarks] = []  # the measured step's handlers
        self._bytes: dict[Any, dict[tuple[int, tuple[str, ...]], list[int]]] = defaultdict(lambda: defaultdict(list))
        self._live_at_peak: dict[Any, int] = {}
        self._kept: dict[Any, set[tuple[int, tuple[str, ...]]]] = defaultdict(set)
        self._peak_seen = -1

    @property
    def measuring(self) -> bool:
        return self.plan is None and self.steps == PROBE_STEPS - 1

    def enabled(self, vp_stage: Any, layer: int, point: str) -> bool:
        return self.plan is None or self.plan.enabled(vp_stage, layer, point)

    # -------------------------------------------------------------------- measurements (probe step)
    def chunk_started(self, vp_stage: Any) -> ChunkMarks | None:
        if not self.measuring:
            return None
        marks = ChunkMarks(vp_stage)
        self._marks.append(marks)
        return marks

    def offloaded(self, vp_stage: Any, layer: int, point: str, nbytes: int) -> None:
        if self.measuring:
            self._bytes[vp_stage][(layer, unit_of(point))].append(nbytes)

    def kept(self, vp_stage: Any, layer: int, point: str) -> None:
        if self.measuring:
            self._kept[vp_stage].add((layer, unit_of(point)))

    def peak_check(self, peak: int, live: dict[Any, int]) -> None:
        """The allocator's peak and the chunk forwards in flight per ``vp_stage``, at each layer start of the
        measured step (with a target only: the peak statistic was reset when that step began)."""
        if self.measuring and peak > self._peak_seen:
            self._peak_seen = peak
            self._live_at_peak = dict(live)

    # ----------------------------------------------------------------------------------- planning
    def step_ended(self, elapsed: Any, link_GBps: float | None, peak_bytes: int | None,
                   off_device_at_peak: int) -> Plan | None:
        """End of a training step; at the end of the probe, build the plan (``elapsed_ms(a, b)`` reads marks)."""
        self.steps += 1
        if self.plan is not None or self.steps < PROBE_STEPS:
            return None
        profiles = self._profiles(elapsed)
        need = None
        if self.target_gib is not None and peak_bytes is not None:
            # The probe offloaded everything: without offloading the peak would be higher by what was off.
            need = peak_bytes + off_device_at_peak - int(self.target_gib * 2**30)
        self.plan = choose(profiles, link_GBps or 1.0, need)
        logger.info("offload auto plan%s: %s", "" if self.target_gib is None else f" (target {self.target_gib} GiB)",
                    self.plan.describe())
        self._marks.clear()
        return self.plan

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
            prof.unit_bytes = {k: int(statistics.median(v)) for k, v in self._bytes[vp].items()}
            prof.live_at_peak = max(1, self._live_at_peak.get(vp, 1))
            prof.kept = set(self._kept[vp])
            out[vp] = prof
        return out
