"""Per-rank offload accounting: bytes per offload point, host-resident high-water mark, and a table.

Counters per point and step: ``offloaded`` (copied to host), ``released_in_forward`` (device storage
actually freed before the chunk's backward began: the bytes that lower the peak), ``released_late``,
``reloaded``, ``reloaded_on_demand`` (the part of ``reloaded`` no prefetch had started when its group's backward
came: the compute stream may wait for it), ``kept_on_device`` (last-layer groups whose backward came first, never
copied) and
``skipped_aliased`` (storages another live tensor still held at offload time and, where a chunk waited for its
backward, at the second look after its forward: copying them frees nothing).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any

from mcore_offload.runtime.peak_trace import PeakTrace
from mcore_offload.runtime.telemetry import StepLink

logger = logging.getLogger(__name__)

# warn_if_copies_exposed: a stall above this share of the step and this many ms says the copies are not hidden. In a
# launch-bound step the GPU waits for the host anyway, so a stall costs less than its length: D-moe's 115 ms of a
# 944 ms step under MCORE_OFFLOAD_D2H_IN_FLIGHT=1 cost about +2 % (session 80) and stays under it; the local spec's
# core_attn, 612 ms of 812, is over it
EXPOSED_STALL_SHARE = 0.25
EXPOSED_STALL_MIN_MS = 10.0
# warn_if_copies_trail: copies still running at a chunk's forward end, over this many bytes and this share of what a
# chunk forward releases, say the copies did not keep up with the forward as the host saw it (a slow link, or a host
# ahead of the GPU; one late layer's bytes are normal)
TRAILING_MIN_BYTES = 64 * 2**20
TRAILING_SHARE = 1 / 4
# ... and at this share or more of it, the host saw no copy finish during the forward: it ran ahead of a GPU-bound
# forward, and only a bound inside the forward lets blocks go before its end (session 85's B: all 1312 MiB trailing;
# the forward-end wait freed nothing more at +2.1 %, MCORE_OFFLOAD_D2H_IN_FLIGHT=2 freed 1150 of 1312 at +2.4 %)
HOST_AHEAD_SHARE = 0.9

COUNTERS = (
    "offloaded",
    "released_in_forward",
    "released_late",
    "reloaded",
    "reloaded_on_demand",
    "kept_on_device",
    "skipped_aliased",
)


def _new_points() -> dict[str, dict[str, int]]:
    return defaultdict(lambda: dict.fromkeys(COUNTERS, 0))


@dataclass
class StepRecord:
    step: int
    aborted: bool
    points: dict[str, dict[str, int]]
    host_buffer_allocations: int = 0  # pinned buffers newly allocated during this step (0 once warm)
    runtime_cpu_ms: float = 0.0  # host time spent inside mcore-offload's hooks during this step
    # GPU-timed link figures, filled in once the step's events are complete (usually at the next step's end)
    link: StepLink | None = None
    # host time from the previous recorded step's end to this one's (None for the first): what the stall is compared
    # with (in runs that pause offloading between steps it spans more than one step, so the share reads low)
    host_step_ms: float | None = None
    # the most bytes still being copied out when one of this step's chunk forwards ended (Transport.trailing_bytes),
    # and how many chunk forwards ended
    trailing_bytes: int = 0
    forward_ends: int = 0

    def total(self, counter: str) -> int:
        return sum(c[counter] for c in self.points.values())

    def released_per_forward(self) -> float:
        """The bytes released during forwards, per chunk forward that ended in this step."""
        return self.total("released_in_forward") / max(self.forward_ends, 1)


@dataclass(slots=True)  # the C++ runtime reads and writes its fields about 45 times a layer-microbatch: one load each
class OffloadSummary:
    """Counters of this rank. ``steps`` holds one record per training step that offloaded anything."""

    steps: list[StepRecord] = field(default_factory=list)
    host_resident_bytes: int = 0
    host_resident_peak_bytes: int = 0
    # Offloaded bytes with no device copy (released, not yet reloaded): what offloading takes off the peak.
    off_device_bytes: int = 0
    off_device_at_peak_bytes: int = 0  # their value when the device peak was reached (see track_peak)
    # track_peak(by_key=True): off-device bytes per entry key (auto's peak step: (vp_stage, layer, point)), and
    # their values when the device peak was reached
    off_by_key: dict[Any, int] | None = None
    off_by_key_at_peak: dict[Any, int] | None = None
    _current: dict[str, dict[str, int]] = field(default_factory=_new_points)
    _peak_reader: Callable[[], int] | None = None
    # track_peak(reset_peak=...): the allocator's peak statistic is reset at each event, and every interval between
    # two events is kept with its bytes off the device (what the step would have peaked at without offloading)
    _peak_resetter: Callable[[], None] | None = None
    peak_trace: PeakTrace | None = None
    _allocations_seen: int = 0
    # Where reloads came on demand, by "step N: key" (key: (chunk, layer, point) in auto's peak step, else the point).
    # Counted where the manager sees each entry (the Python path, and any step that traces the peak); the C++ path's
    # untraced bursts count per point only.
    on_demand_by_key: dict[str, int] = field(default_factory=dict)
    _last_peak: int = 0
    runtime_ns: int = 0  # host time inside the runtime's Python hooks since the last closed step
    # the C++ paths' part of it (a native RuntimeClock, set by the manager where the C++ runtime is loaded): an int64
    # the hooks add to without a Python int per call; runtime_total_ns() adds the two
    native_clock: Any = None
    _closed_at_ns: int | None = None  # perf_counter_ns() at the last close_step
    exposed_copies_warned: bool = False  # warn_if_copies_exposed says it once per rank
    trailing_copies_warned: bool = False  # warn_if_copies_trail says it once per rank
    # the manager's HostAheadAdapter, where it acts on a host that runs ahead (it logs its own line there)
    host_ahead: Any = None

    def runtime_total_ns(self) -> int:
        """Host time inside the runtime's hooks since the last closed step, Python's and C++'s."""
        return self.runtime_ns + (self.native_clock.ns if self.native_clock is not None else 0)

    def add(self, point: str, counter: str, nbytes: int) -> None:
        self._current[point][counter] += nbytes

    def add_on_demand(self, point: str, key: Any, nbytes: int) -> None:
        """A reload no prefetch had started: counted for its point, and under this step and its key."""
        self.add(point, "reloaded_on_demand", nbytes)
        where = f"step {len(self.steps)}: {key or point}"
        self.on_demand_by_key[where] = self.on_demand_by_key.get(where, 0) + nbytes

    def point_totals(self, counter: str) -> dict[str, int]:
        """This step's ``counter`` so far, per point."""
        return {point: counts[counter] for point, counts in self._current.items()}

    def host_resident(self, delta: int) -> None:
        self.host_resident_bytes += delta
        self.host_resident_peak_bytes = max(self.host_resident_peak_bytes, self.host_resident_bytes)

    def off_device(self, delta: int, key: Any = None) -> None:
        self._probe_peak()
        self.off_device_bytes += delta
        if self.off_by_key is not None and key is not None:
            self.off_by_key[key] = self.off_by_key.get(key, 0) + delta

    def track_peak(self, read_peak: Callable[[], int], by_key: bool = False,
                   reset_peak: Callable[[], None] | None = None) -> None:
        """Attribute the device peak: call right after resetting the allocator's peak statistic.

        ``off_device_bytes`` only changes at our own release / reload events, so reading the peak at each
        event tells exactly in which interval it rose, and the value it had there. It costs one allocator
        statistics read per event, which is why it is off unless asked for (the benchmark's step 1).

        With ``reset_peak`` (resets the statistic) every interval's own peak is read and kept in :attr:`peak_trace`
        (auto's peak step); :attr:`traced_peak_bytes` is then the step's peak, since the statistic no longer is.
        """
        self._peak_reader = read_peak
        self._last_peak = read_peak()
        self._peak_resetter = reset_peak
        self.peak_trace = PeakTrace() if reset_peak is not None else None
        self.off_device_at_peak_bytes = self.off_device_bytes
        self.off_by_key = {} if by_key else None
        self.off_by_key_at_peak = {} if by_key else None

    def stop_tracking_peak(self) -> None:
        self._probe_peak()
        self._peak_reader = None
        self._peak_resetter = None  # peak_trace stays for the caller
        self.off_by_key = None  # off_by_key_at_peak stays for the caller

    @property
    def tracing(self) -> bool:
        """Whether the peak is being traced (:meth:`track_peak`): every change of the bytes off the device must then
        be reported on its own, since each one reads the allocator's peak."""
        return self._peak_reader is not None or self.off_by_key is not None

    @property
    def traced_peak_bytes(self) -> int:
        """The device peak since :meth:`track_peak`, as of the last event."""
        return self._last_peak

    @property
    def traces_plain_peak(self) -> bool:
        """Whether every interval is being kept (:meth:`track_peak` with ``reset_peak``)."""
        return self._peak_resetter is not None

    def peak_so_far(self) -> int:
        """The device peak since :meth:`track_peak`, now (the statistic alone is its interval's once reset)."""
        return max(self._last_peak, self._peak_reader()) if self._peak_reader is not None else self._last_peak

    def _probe_peak(self) -> None:
        if self._peak_reader is not None:
            peak = self._peak_reader()
            if self._peak_resetter is not None:
                self._peak_resetter()
                self.peak_trace.add(peak, self.off_device_bytes, self.off_by_key)
            if peak > self._last_peak:
                self._last_peak, self.off_device_at_peak_bytes = peak, self.off_device_bytes
                if self.off_by_key is not None:
                    self.off_by_key_at_peak = {k: v for k, v in self.off_by_key.items() if v > 0}

    def step_has_activity(self) -> bool:
        return bool(self._current)

    def close_step(self, aborted: bool = False) -> None:
        from mcore_offload.runtime.transport import live_transports

        transports = live_transports()
        points = {k: dict(v) for k, v in self._current.items()}
        allocations = sum(t.pool.allocations for t in transports)
        now = perf_counter_ns()
        record = StepRecord(len(self.steps), aborted, points, allocations - self._allocations_seen,
                            runtime_cpu_ms=self.runtime_total_ns() / 1e6,
                            host_step_ms=None if self._closed_at_ns is None else (now - self._closed_at_ns) / 1e6,
                            trailing_bytes=max((t.trailing_bytes for t in transports), default=0),
                            forward_ends=sum(t.forward_ends for t in transports))
        self._closed_at_ns = now
        self.steps.append(record)
        self.warn_if_copies_trail(record)
        self._allocations_seen = allocations
        self._current = _new_points()
        self.runtime_ns = 0
        if self.native_clock is not None:
            self.native_clock.take()
        for t in transports:
            t.telemetry.end_step(record.step)
            t.trailing_bytes = t.forward_ends = 0  # taken by this record
        self.resolve_link()

    def resolve_link(self, wait: bool = False) -> None:
        """Attach the link figures of every step whose timing events are complete (all with ``wait``).

        ``wait=True`` synchronises with the GPU: call it after training, never inside a step.
        """
        from mcore_offload.runtime.transport import live_transports

        for t in live_transports():
            for step, link in t.telemetry.resolve(wait=wait):
                if step < len(self.steps):
                    self.steps[step].link = link
                    rec = self.steps[step]
                    logger.info(
                        "offload step %d: stall %s ms, D2H %s GB/s (%.1f MiB), H2D %s GB/s (%.1f MiB), "
                        "runtime host time %.2f ms", step, _fmt(link.stall_ms), _fmt(link.d2h_GBps),
                        link.d2h_bytes / 2**20, _fmt(link.h2d_GBps), link.h2d_bytes / 2**20, rec.runtime_cpu_ms)
                    self.warn_if_copies_exposed(rec)

    def warn_if_copies_exposed(self, rec: StepRecord) -> bool:
        """Once per rank: a warning where the compute stream waited on the copies for over a quarter of the step (and
        over 10 ms), i.e. the offloaded bytes do not fit under the compute that should hide them. True if it warned."""
        link = rec.link
        if self.exposed_copies_warned or link is None or link.stall_ms is None or not rec.host_step_ms:
            return False
        if link.stall_ms <= max(EXPOSED_STALL_MIN_MS, EXPOSED_STALL_SHARE * rec.host_step_ms):
            return False
        self.exposed_copies_warned = True
        logger.warning(
            "offload step %d: the compute stream waited %.0f ms on the copies, %.0f %% of the step, so the link cannot "
            "move these %.0f MiB out and back under this step's compute: offload fewer points (the largest per point "
            "are in the summary table) or let offload_modules=['auto'] choose", rec.step, link.stall_ms,
            100 * link.stall_ms / rec.host_step_ms, max(link.d2h_bytes, link.h2d_bytes) / 2**20)
        return True

    def warn_if_copies_trail(self, rec: StepRecord) -> bool:
        """Once per rank: a warning where at least 64 MiB, and a quarter of what one chunk forward releases on
        average, were still being copied out when a chunk's forward ended. Those blocks are still allocated at a peak
        that comes there, so the peak drops by less than the offloaded bytes, and by a different amount from step to
        step (session 83: A's attention set on a fast host, 22-40 of 50 steps 114-674 MiB higher, about 1,335 MiB a
        forward). The last layer flushed at a forward's end is normally still being copied: that much does not
        warn. The advice follows the cause: with (nearly) all of a forward's bytes trailing, the host ran ahead of the
        GPU and the peak inside the forward needs the bound, not the forward-end wait (session 85's B). True if it
        warned."""
        released = rec.released_per_forward()
        if self.trailing_copies_warned or rec.trailing_bytes < max(TRAILING_MIN_BYTES, released * TRAILING_SHARE):
            return False
        ahead = host_ran_ahead(rec)
        if ahead and self.host_ahead is not None and self.host_ahead.speaks_for_host_ahead:
            return False  # the runtime switches its settings itself (runtime/host_ahead.py) and says so
        self.trailing_copies_warned = True
        if ahead:
            advice = ("the host ran ahead of the GPU and saw none of this forward's copies finish, so no copied block "
                      "went back before the forward's end. Set MCORE_OFFLOAD_D2H_IN_FLIGHT=2 with "
                      "MCORE_OFFLOAD_FLUSH_LAYERS=1 (what MCORE_OFFLOAD_HOST_AHEAD=adapt, the default, switches to "
                      "where none of the copy-out variables is set): the compute stream then waits on the GPU for "
                      "older bursts during the forward and their blocks go back at once, which may cost step time; "
                      "MCORE_OFFLOAD_FORWARD_END=wait acts only at the forward's end and does not help a peak inside "
                      "it")
        else:
            advice = ("the link behind the forward. Set MCORE_OFFLOAD_FORWARD_END=wait (the compute stream waits for "
                      "those copies at the forward's end, for a peak after it) or MCORE_OFFLOAD_D2H_IN_FLIGHT=1 (and "
                      "for older bursts during it), either of which may cost step time, or offload fewer points")
        logger.warning(
            "offload step %d: %.0f MiB were still being copied to the host when a chunk's forward ended, so they "
            "still counted at a peak there: the peak drops by up to that much less than the %.0f MiB a forward "
            "offloads on average. Likely cause: %s", rec.step, rec.trailing_bytes / 2**20, released / 2**20, advice)
        return True

    def link_series(self) -> dict[str, list]:
        """Per step: stall_ms (bound_ms of it on copy-out bursts), d2h_GBps, h2d_GBps, runtime_cpu_ms (None where not
        measured), trailing_bytes."""
        def col(name: str) -> list:
            return [None if s.link is None else getattr(s.link, name) for s in self.steps]

        return {"stall_ms": col("stall_ms"), "bound_ms": col("bound_ms"), "d2h_GBps": col("d2h_GBps"),
                "h2d_GBps": col("h2d_GBps"),
                "d2h_bytes": col("d2h_bytes"), "h2d_bytes": col("h2d_bytes"),
                "runtime_cpu_ms": [s.runtime_cpu_ms for s in self.steps],
                "trailing_bytes": [s.trailing_bytes for s in self.steps]}

    @property
    def last_step(self) -> StepRecord | None:
        return self.steps[-1] if self.steps else None

    def as_dict(self) -> dict[str, Any]:
        from mcore_offload.runtime.transport import live_transports

        last, transports = self.last_step, live_transports()
        return {
            "steps": len(self.steps),
            "last_step": last.points if last else {},
            "host_resident_peak_bytes": self.host_resident_peak_bytes,
            "host_resident_bytes": self.host_resident_bytes,
            "off_device_bytes": self.off_device_bytes,
            "off_device_at_peak_bytes": self.off_device_at_peak_bytes,
            "host_buffer_allocations": sum(t.pool.allocations for t in transports),
            "host_buffer_allocations_per_step": [s.host_buffer_allocations for s in self.steps],
            "reloaded_on_demand_per_step": [s.total("reloaded_on_demand") for s in self.steps],
            "on_demand_by_key": dict(self.on_demand_by_key),
            "host_buffer_bytes": sum(t.pool.allocated_bytes for t in transports),
            # MCORE_OFFLOAD_D2H_IN_FLIGHT: the compute stream's waits for copy-out bursts so far (0 when unbounded)
            "d2h_in_flight_waits": sum(t.in_flight_waits for t in transports),
            "per_step": self.link_series(),
            # runtime/host_ahead.py: whether the runtime switched its copy-out settings, and when
            "host_ahead": None if self.host_ahead is None else self.host_ahead.as_dict(),
        }

    def table(self, rank: int | None = None) -> str:
        """The last step per point, in MiB, as a fixed-width table."""
        last = self.last_step
        head = f"mcore-offload summary{'' if rank is None else f' (rank {rank})'}"
        if last is None:
            return f"{head}: nothing offloaded yet"
        mib = 1024 * 1024
        cols = ("point",) + COUNTERS
        lines = [head + f", step {last.step}" + (" (aborted)" if last.aborted else ""),
                 " ".join(f"{c:>20}" for c in cols)]
        for name in sorted(last.points):
            row = last.points[name]
            lines.append(f"{name:>20} " + " ".join(f"{row[c] / mib:>20.2f}" for c in COUNTERS))
        lines.append(f"{'all (MiB)':>20} " + " ".join(f"{last.total(c) / mib:>20.2f}" for c in COUNTERS))
        lines.append(f"host-resident high-water mark: {self.host_resident_peak_bytes / mib:.2f} MiB")
        lines.append(f"runtime host time: {last.runtime_cpu_ms:.2f} ms")
        if last.link is not None:
            lines.append(f"link: stall {_fmt(last.link.stall_ms)} ms, D2H {_fmt(last.link.d2h_GBps)} GB/s, "
                         f"H2D {_fmt(last.link.h2d_GBps)} GB/s")
        if last.trailing_bytes:
            lines.append(f"copies still running at a chunk's forward end: {last.trailing_bytes / mib:.2f} MiB "
                         "(the most this step; still allocated at a peak there)")
        from mcore_offload.runtime.transport import live_transports

        transports = live_transports()
        bound = max((t.d2h_in_flight for t in transports), default=0)
        waits = sum(t.in_flight_waits for t in transports)
        adapter = self.host_ahead
        if adapter is not None and adapter.adapted_at is not None:
            lines.append(f"host ahead of the GPU: per-layer copy-out bursts from step {adapter.adapted_at}, "
                         f"{adapter.state} (MCORE_OFFLOAD_HOST_AHEAD)")
        elif adapter is not None and adapter.state == "reverted":  # the probe's own waits sent it back
            lines.append(f"host ahead of the GPU: per-layer copy-out bursts probed, reverted after the compute stream "
                         f"waited {adapter.bound_ms:.1f} ms on them in step {adapter.judged_at}: the defaults with the "
                         f"forward-end wait (MCORE_OFFLOAD_HOST_AHEAD)")
        if bound:
            lines.append(f"copy-out bound: {bound} burst(s) in flight (MCORE_OFFLOAD_D2H_IN_FLIGHT), "
                         f"{waits} waits so far")
        elif any(t.wait_at_forward_end for t in transports):
            reverted = adapter is not None and adapter.state == "reverted"
            how = "after a revert" if reverted else "MCORE_OFFLOAD_FORWARD_END=wait"
            lines.append(f"copy-out waited for at forward ends ({how}), {waits} waits so far")
        return "\n".join(lines)


def host_ran_ahead(rec: StepRecord) -> bool:
    """Whether nearly all a forward released was still being copied at its end (at least ``TRAILING_MIN_BYTES``):
    the host saw no copy-out burst finish during the forward, i.e. it ran ahead of a GPU-bound forward."""
    return rec.trailing_bytes >= max(TRAILING_MIN_BYTES, HOST_AHEAD_SHARE * rec.released_per_forward())


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def get_summary() -> OffloadSummary:
    """This rank's summary (a live object; it keeps counting)."""
    from mcore_offload.runtime.manager import get_manager

    return get_manager().summary


def gather_summaries(group: Any = None) -> list[dict[str, Any]] | None:
    """Every rank of ``group`` calls this; rank 0 of the group gets all ranks' dicts, others None.

    The collective runs on ``group`` only (default: the whole world), so it completes exactly when every
    rank of that group reaches it; never call it from a code path that only some of its ranks take.
    """
    import torch.distributed as dist

    mine = get_summary().as_dict()
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    mine["rank"] = dist.get_rank()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return gathered if dist.get_rank(group) == 0 else None


def format_rank_table(rows: list[dict[str, Any]]) -> str:
    """One line per rank: bytes offloaded in the last step per point and the host high-water mark."""
    mib = 1024 * 1024
    lines = [f"{'rank':>5} {'point':>12} {'offloaded MiB':>14} {'released MiB':>13} {'host peak MiB':>14}"]
    for r in rows:
        for name, c in sorted(r["last_step"].items()):
            lines.append(f"{r.get('rank', 0):>5} {name:>12} {c['offloaded'] / mib:>14.2f} "
                         f"{c['released_in_forward'] / mib:>13.2f} "
                         f"{r['host_resident_peak_bytes'] / mib:>14.2f}")
    return "\n".join(lines)
