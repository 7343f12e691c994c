"""``offload_modules=["auto"]``: choose, per chunk and layer, what to offload so that the copies stay hidden.

Spelling: ``["auto"]`` keeps every copy hidden; ``["auto:<GiB>"]`` (``"auto:38.5"``) offloads just enough to
bring this rank's peak allocated memory to that many GiB, preferring hidden copies.

How: the first :data:`PROBE_STEPS` training steps offload every point (so the probe itself cannot run out
of memory). The second (the *measured* step) times each layer's forward on the compute stream (timing
events at layer boundaries: real time on the GPU's timeline, launch gaps included, which is the window the
copy engine has) and counts the bytes each point's storages take per layer, the D2H throughput the link achieved
and the runtime's host time. The third (the *peak* step, on a GPU) traces the peak the step would reach without
offloading, interval by interval, and the bytes of each (chunk, layer, point) off the device in each interval
(:mod:`mcore_offload.runtime.peak_trace`; a unit that is back on the device where the step peaks saves nothing:
under pipeline parallelism, a chunk's last layer). That takes an allocator statistics read and reset at every
release and reload, host time that would inflate the measured step's host time and exposure (on A it tripled the
host time per group and the plan chose nothing), so the two never share a step. At the end of the peak step
:func:`choose` picks the units (a point, or core_attn with attn_proj, which share attention's output in 16-bit
training; under FP8 or core_attn recompute each is a unit of its own, see :func:`attention_units`)
greedily, most peak bytes first (following the peak as it moves to another interval), keeping each one only if
a simulated copy queue still finishes every layer's copies before the layer after next starts. Steps after that
offload the chosen (chunk, layer, point) only. The plan is logged once per rank.

Host time is a cost too. Where the step is launch-bound (the GPU has caught up with the host: at a layer's
start the previous layer's start mark has already run on the GPU), every microsecond the runtime spends on
the host is step time (measured: ``benchmarks/host_delay.py``). The probe step measures that share (the
*exposure*) and the runtime's host time per group; the choice then spends at most :data:`HOST_BUDGET` of the
step on exposed host time, the bytes each unit moves counted too (:data:`TRAFFIC_SHARE_PER_GIB`), preferring the
units with the most bytes per exposed host millisecond.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from typing import Any

from mcore_offload.config import attn_proj_frees_alone, choice_env, nonnegative_float_env, selectively_recomputed
from mcore_offload.runtime.auto_choice import (
    HOST_BUDGET,
    OUTSIDE_CLOCK,
    ChunkProfile,
    HostCost,
    Plan,
    choose,
    host_cost,
)
from mcore_offload.runtime.auto_record import to_record
from mcore_offload.runtime.peak_trace import PeakTrace

logger = logging.getLogger(__name__)

AUTO = "auto"
#: Steps that offload everything: step 0 also autotunes kernels, step 1 is the measured step, step 2 the peak
#: step (see the module docstring); the plan starts with step 3.
PROBE_STEPS = 3
#: Offload points planned together: attn_proj saves a view of core attention's output (one storage).
UNITS: tuple[tuple[str, ...], ...] = (
    ("attn_norm",), ("qkv_linear",), ("core_attn", "attn_proj"), ("mlp_norm",), ("expert_fc1",), ("moe_act",),
)
#: Every point its own unit: where attn_proj's saved tensor is a storage of its own (FP8: TE's projection keeps an
#: FP8 copy; core_attn recompute: the checkpoint keeps no output), planning the two together would make auto take
#: core_attn's large, often exposed bytes to get attn_proj's small, hidden ones, or neither.
SPLIT_UNITS: tuple[tuple[str, ...], ...] = tuple((p,) for u in UNITS for p in u)
#: Overrides :data:`~mcore_offload.runtime.auto_choice.OUTSIDE_CLOCK` (0: price a group at the runtime's clock
#: alone, as before session 67), for comparing the two host-time models on one host.
OUTSIDE_CLOCK_VARIABLE = "MCORE_OFFLOAD_AUTO_OUTSIDE_CLOCK"
#: 1: price host time at the mean of the forward's and the backward's exposure (the forward's alone by default;
#: a candidate for partly GPU-bound steps, not yet measured on a GPU).
BACKWARD_EXPOSURE_VARIABLE = "MCORE_OFFLOAD_AUTO_BACKWARD_EXPOSURE"
#: Overrides :data:`~mcore_offload.runtime.auto_choice.HOST_BUDGET`, the share of the plain step that the chosen
#: groups' exposed host time may cost (0.015 by default, under issue 5's +2 %). A larger share buys more of the full
#: set's saving at more step time; ``benchmarks/auto_replay.py`` shows from one run's record what each share buys.
HOST_BUDGET_VARIABLE = "MCORE_OFFLOAD_AUTO_HOST_BUDGET"


def outside_clock_setting() -> float:
    """The host time a group costs outside the runtime's clock, relative to the clock (:data:`OUTSIDE_CLOCK_VARIABLE`
    or :data:`~mcore_offload.runtime.auto_choice.OUTSIDE_CLOCK`)."""
    return nonnegative_float_env(OUTSIDE_CLOCK_VARIABLE, OUTSIDE_CLOCK,
                                 f"set it to e.g. 0 (the runtime's clock alone) or unset it for {OUTSIDE_CLOCK}.")


def host_budget_setting() -> float:
    """The share of the plain step that the plan may spend on exposed host time (:data:`HOST_BUDGET_VARIABLE` or
    :data:`~mcore_offload.runtime.auto_choice.HOST_BUDGET`)."""
    share = nonnegative_float_env(HOST_BUDGET_VARIABLE, HOST_BUDGET,
                                  f"set it to a share of the step such as 0.03, or unset it for {HOST_BUDGET}.")
    if share >= 1.0:
        raise ValueError(f"{HOST_BUDGET_VARIABLE}={share:g} is a share of the step and must be under 1; set it to "
                         f"e.g. 0.03 (3 %), or unset it for {HOST_BUDGET}.")
    return share


def auto_settings() -> tuple[float, bool, float]:
    """``(outside_clock, backward_exposure, host_budget)`` from the environment, each checked: config validation calls
    this too, so that a bad value stops the run when the config is made, not at its first forward."""
    return (outside_clock_setting(), choice_env(BACKWARD_EXPOSURE_VARIABLE, "0", ("0", "1")) == "1",
            host_budget_setting())


def attention_units(config: Any) -> tuple[tuple[str, ...], ...]:
    """The units auto plans for ``config``: :data:`SPLIT_UNITS` where attn_proj alone frees memory (the rule the
    config's validation applies to an explicit list), else :data:`UNITS`."""
    return SPLIT_UNITS if attn_proj_frees_alone(selectively_recomputed(config), bool(getattr(config, "fp8", None))) \
        else UNITS


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


def unit_of(point: str, units: tuple[tuple[str, ...], ...] = UNITS) -> tuple[str, ...]:
    return next(u for u in units if point in u)


class ChunkMarks:
    """Clock marks of one chunk's forward in the measured step: each layer's start, and the forward's end.

    ``checks`` / ``caught_up``: layer starts at which the previous layer's start mark was looked at, and how many
    times the GPU had already reached it (the host was less than a layer ahead: launch-bound there). On the H100
    this share matched the measured exposure (B: 0.25 against 0.25 from the attention set's overhead over its host
    time; A and C: ~1). A narrower test (a mark at a flush's start, checked at its end) read 0.50 on A and 0.01 on
    B: in a launch-bound step a queue that is not yet empty still runs dry later, so it is no test.

    ``by_layer``: for each layer start after the first (layer 2, 3, ...), whether the GPU had caught up there (None:
    not checked); logged per layer with the plan, to show where a step exposes host time.

    ``bwd_checks`` / ``bwd_caught_up``: the same test in this forward's backward, at the first group hook of each
    layer against the previous layer's (:meth:`backward_group`). The forward test alone read B's exposure as 0.25
    (one microbatch forward in four) where its plans cost a third of what that predicts (session 68).
    """

    __slots__ = ("vp_stage", "layers", "end", "checks", "caught_up", "by_layer", "bwd_layer", "bwd_mark",
                 "bwd_checks", "bwd_caught_up")

    def __init__(self, vp_stage: Any) -> None:
        self.vp_stage = vp_stage
        self.layers: list[Any] = []
        self.end: Any = None
        self.checks = 0
        self.caught_up = 0
        self.by_layer: list[bool | None] = []
        self.bwd_layer: int | None = None
        self.bwd_mark: Any = None
        self.bwd_checks = 0
        self.bwd_caught_up = 0

    def layer_started(self, mark: Any) -> None:
        """A layer starts (``mark``: its clock mark): note whether the device already ran the previous start."""
        if self.layers:
            done = reached(self.layers[-1])
            if done is not None:
                self.checks += 1
                self.caught_up += done
            self.by_layer.append(done)
        self.layers.append(mark)

    def backward_group(self, layer: int, device: Any) -> None:
        """A group of ``layer`` starts its backward: at the first group of each layer, note whether the device had run
        the previous layer's backward mark, then mark this layer."""
        if layer == self.bwd_layer:
            return
        if self.bwd_mark is not None:
            done = reached(self.bwd_mark)
            if done is not None:
                self.bwd_checks += 1
                self.bwd_caught_up += done
        self.bwd_layer, self.bwd_mark = layer, clock_mark(device)


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


def largest_in_pipeline(exposure: float | None) -> float | None:
    """The largest ``exposure`` over this rank's pipeline-parallel group (one all-reduce where PP > 1; every rank of
    the group calls this at the end of the same measured step). None where no rank measured one (the CPU).

    Why: under pipelining a rank's GPU also waits for its neighbour's activations and gradients, and a GPU held up
    there looks, to the layer-start test, like a host that is ahead: D-dense's rank 1 read 0.00 in one probe and 0.75
    in the next; planned on the 0.00, everything on that rank cost +6.3 % of the step (its runtime's clock 20.5 ms
    of about 460; 2x H200, session 68). The pipeline's ranks wait on each other, so the host time one of them
    exposes is bounded by what the most exposed rank reads."""
    import torch

    try:
        from megatron.core import parallel_state
    except ImportError:  # no megatron-core: no pipeline
        return exposure
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return exposure
    if parallel_state.get_pipeline_model_parallel_world_size() <= 1:
        return exposure
    group = parallel_state.get_pipeline_model_parallel_group()
    on_gpu = "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available()
    value = torch.tensor([-1.0 if exposure is None else float(exposure)], dtype=torch.float64,
                         device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    largest = float(value.item())
    return None if largest < 0 else largest


def caught_up_by_layer(marks: list[ChunkMarks]) -> str:
    """Per chunk and layer, how many of its forwards found the GPU caught up at that layer's start: ``"chunk None:
    L2 4/4 L3 0/4"`` (a layer start is checked against the previous one's mark, so the first layer has none)."""
    counts: dict[Any, dict[int, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for m in marks:
        for i, done in enumerate(m.by_layer):
            if done is not None:
                seen = counts[m.vp_stage][i + 2]
                seen[0] += done
                seen[1] += 1
    return "; ".join(f"chunk {vp}: " + " ".join(f"L{layer} {c}/{n}" for layer, (c, n) in sorted(layers.items()))
                     for vp, layers in sorted(counts.items(), key=lambda kv: str(kv[0])))


class AutoPlanner:
    """Per-process state of an auto run: probing, then a fixed plan (one per manager; reset with it)."""

    def __init__(self, target_gib: float | None, units: tuple[tuple[str, ...], ...] = UNITS) -> None:
        self.target_gib = target_gib
        self.units = units  # UNITS or SPLIT_UNITS (attention_units)
        self.outside_clock, self.backward_exposure, self.host_budget = auto_settings()
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
        self.record: dict[str, Any] | None = None  # what the plan was chosen from (runtime/auto_record.py)

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
            self._bytes[vp_stage][(layer, unit_of(point, self.units))][microbatch] += nbytes

    def kept(self, vp_stage: Any, layer: int, point: str) -> None:
        if self.measuring:
            self._kept[vp_stage].add((layer, unit_of(point, self.units)))

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
                   off_at_peak: dict[tuple[Any, int, str], int] | None = None,
                   trace: PeakTrace | None = None) -> Plan | None:
        """End of a training step. At the end of the measured step, keep its measurements (``elapsed_ms(a, b)``
        reads marks; ``link_GBps``; ``runtime_ms``: the runtime's host time in the step); at the end of the peak
        step, build the plan (``peak_bytes``, ``off_device_at_peak``; ``off_at_peak``: (vp_stage, layer, point) ->
        bytes off the device when the step's peak was reached, None where it was not traced; ``trace``: the peak
        step's intervals keyed by (vp_stage, layer, point), runtime/peak_trace.py, which the plan then follows)."""
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
        if trace is not None and len(trace):
            return self._plan_for_trace(profiles, host, link, trace, peak_bytes)
        # A probe whose peak came with nothing off the device peaked elsewhere (B on the H100: with every point
        # offloaded, the step peaks while the first backward allocates the gradients). A smaller plan moves the
        # peak back to where activations are held, so the trace says nothing about the units: rank them by bytes.
        untraced_peak = off_at_peak is not None and not any(off_at_peak.values())
        if off_at_peak is not None and not untraced_peak:
            for prof in profiles.values():
                prof.peak_bytes = {}
            for (vp, layer, point), nbytes in off_at_peak.items():
                if vp in profiles:
                    key = (layer, unit_of(point, self.units))
                    profiles[vp].peak_bytes[key] = profiles[vp].peak_bytes.get(key, 0) + nbytes
        for vp, prof in profiles.items():
            prof.live_at_peak = max(1, self._live_at_peak.get(vp, 1))
        need = None
        if self.target_gib is not None and peak_bytes is not None:
            # The probe offloaded everything: without offloading the peak would be higher by what was off.
            need = peak_bytes + off_device_at_peak - int(self.target_gib * 2**30)
        self.plan = choose(profiles, link, need, host)
        self.record = to_record(profiles, host, link, need, None, self.plan)
        if untraced_peak:
            self.plan.note = "; ".join(filter(None, [self.plan.note, "ranked by bytes: the probe peaked with nothing "
                                                    "off the device"]))
        logger.info("offload auto plan%s: %s", "" if self.target_gib is None else f" (target {self.target_gib} GiB)",
                    self.plan.describe())
        self._measured = None
        return self.plan

    def _plan_for_trace(self, profiles: dict[Any, ChunkProfile], host: HostCost | None, link: float,
                        trace: PeakTrace, probe_peak: int | None) -> Plan:
        """The plan for the peak the step would reach without offloading (runtime/peak_trace.py)."""
        units = trace.regroup(lambda k: (k[0], k[1], unit_of(k[2], self.units)) if k[0] in profiles else None)
        plain = units.plain_peak
        logger.info("offload auto probe: without offloading the traced step would peak at %.2f GiB (%d intervals "
                    "between release and reload events; the probe itself peaked at %.2f GiB)", plain / 2**30,
                    len(units), (probe_peak or 0) / 2**30)
        need = None if self.target_gib is None else plain - int(self.target_gib * 2**30)
        self.plan = choose(profiles, link, need, host, trace=units)
        self.record = to_record(profiles, host, link, need, units, self.plan)
        logger.info("offload auto plan%s: %s", "" if self.target_gib is None else f" (target {self.target_gib} GiB)",
                    self.plan.describe())
        self._measured = None
        return self.plan

    def _measured_step(self, elapsed: Any, link_GBps: float | None, runtime_ms: float, chaining: bool) -> None:
        """Read the measured step's clocks and keep what the plan needs."""
        wall_ms = (time.perf_counter() - self._probe_t0) * 1e3 if self._probe_t0 is not None else 0.0
        profiles = self._profiles(elapsed)
        checks = sum(m.checks for m in self._marks)
        own = sum(m.caught_up for m in self._marks) / checks if checks else None
        bwd_checks = sum(m.bwd_checks for m in self._marks)
        bwd_caught_up = sum(m.bwd_caught_up for m in self._marks)
        backward = bwd_caught_up / bwd_checks if bwd_checks else None
        if backward is not None:
            logger.info("offload auto probe: backward layer starts where the GPU had caught up: %d of %d (%.2f; "
                        "forward %s)%s", bwd_caught_up, bwd_checks, backward,
                        "-" if own is None else f"{own:.2f}",
                        ", priced at their mean" if self.backward_exposure and own is not None else "")
            if self.backward_exposure and own is not None:
                # the runtime's host time is about half forward (main thread) and half backward (session 67)
                own = 0.5 * (own + backward)
        exposure = largest_in_pipeline(own)
        if exposure != own:
            logger.info("offload auto probe: exposure %.2f on this rank, %.2f the largest of its pipeline's ranks; the "
                        "plan uses the largest", own if own is not None else float("nan"), exposure)
        microbatches: dict[Any, int] = defaultdict(int)
        for m in self._marks:
            microbatches[m.vp_stage] += 1
        units = {vp: set(p.unit_bytes) | p.kept for vp, p in profiles.items()}
        host = host_cost(runtime_ms, wall_ms, exposure, microbatches, units, chaining, self.outside_clock,
                         self.host_budget)
        if checks:
            logger.info("offload auto probe: layer starts where the GPU had caught up with the host, of the "
                        "measured step's microbatches: %s", caught_up_by_layer(self._marks))
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
