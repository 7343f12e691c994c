"""Per-step link telemetry: how long the compute stream waited for reloads, and the copy throughput.

Everything is timed on the GPU with timing events: a mark before each copy burst (one offload flush, one reload
batch) and the burst's own done event after it; for a wait of the compute stream on a reload, a mark where the
compute stream reaches the wait and the awaited burst's done event (the stall is their distance, or 0 when the copy
finished first). Reading an event's time needs it to
be complete, and waiting for that inside a step would be a host synchronisation, so a step's events are
read at the end of the *next* step (by then the GPU has long passed them; ``query()`` confirms it), or
on demand by :meth:`LinkTelemetry.resolve` with ``wait=True`` (the benchmark, after its last step).

Marks are pooled: after step 1 no mark is created, only re-recorded (done events belong to the transport).

Timing is sampled by step: the first :data:`ALWAYS_TIMED_STEPS` steps, then every ``every``-th
(``MCORE_OFFLOAD_TELEMETRY_EVERY``, default :data:`DEFAULT_EVERY`; 1 times every step). Each timed step costs
three more CUDA calls per offloaded group (a start mark per copy burst and an arrival mark per wait) and one
elapsed-time read per mark, and inside a launch-bound step each CUDA call costs 8-10 µs of host time (session 11).
Untimed steps still count bytes and waits; their times are None. The ``auto`` probe's measured step is always
timed (the manager forces it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcore_offload.config import positive_int_env

logger = logging.getLogger(__name__)

ALWAYS_TIMED_STEPS = 4
DEFAULT_EVERY = 4


def every_from_env() -> int:
    """``MCORE_OFFLOAD_TELEMETRY_EVERY`` as a positive int (a bad value: one clear sentence)."""
    return positive_int_env("MCORE_OFFLOAD_TELEMETRY_EVERY", DEFAULT_EVERY,
                            "set it to 1 to time every step, or N to time every N-th step")


@dataclass
class StepLink:
    """One step's link figures (``None`` where nothing of that kind happened or no clock exists)."""

    stall_ms: float | None = None
    d2h_GBps: float | None = None
    h2d_GBps: float | None = None
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    d2h_ms: float | None = None
    h2d_ms: float | None = None
    waits: int = 0
    # the part of stall_ms spent waiting for copy-out bursts (MCORE_OFFLOAD_D2H_IN_FLIGHT, the forward-end wait, the
    # host-ahead switch), not for reloads
    bound_ms: float | None = None


@dataclass
class _Pending:
    step: int
    # (kind, start event, end event, bytes, end event is the caller's); kind is "d2h", "h2d", "stall" (a wait for a
    # reload) or "bound" (a wait for a copy-out burst)
    spans: list[tuple[str, Any, Any, int, bool]] = field(default_factory=list)


class LinkTelemetry:
    """Collects timed spans for the current step; resolves finished steps into :class:`StepLink`.

    ``new_event`` makes a timing event (CUDA: ``torch.cuda.Event(enable_timing=True)``); it needs
    ``record(stream)``, ``query()``, ``synchronize()`` and ``elapsed_time(other)`` in milliseconds.
    With ``new_event=None`` (the CPU transport) only bytes are counted.
    """

    def __init__(self, new_event: Callable[[], Any] | None, every: int | None = None) -> None:
        self._new_event = new_event
        self.every = every_from_env() if every is None else every
        #: whether the current step is timed (see the module docstring); the manager may set it for a step
        self.timing = new_event is not None
        self._free: list[Any] = []
        self._current = _Pending(step=0)
        self._unresolved: list[_Pending] = []
        self.events_created = 0

    @property
    def timed(self) -> bool:
        return self._new_event is not None

    def mark(self, stream: Any) -> Any:
        """Record a timing event on ``stream`` now (None without a clock, or in an untimed step)."""
        if not self.timing:
            return None
        ev = self._free.pop() if self._free else None
        if ev is None:
            ev = self._new_event()
            self.events_created += 1
        ev.record(stream)
        return ev

    def span(self, kind: str, start: Any, end: Any, nbytes: int = 0, keep_end: bool = False) -> None:
        """A timed span; ``keep_end``: ``end`` is the caller's event (a copy burst's done event, which others
        still wait on), so it never returns to the pool."""
        self._current.spans.append((kind, start, end, nbytes, keep_end))

    def end_step(self, step: int) -> None:
        """The step ``step`` ended: its spans wait to be read; earlier finished steps are read now."""
        self._current.step = step
        self._unresolved.append(self._current)
        self._current = _Pending(step=step + 1)
        following = step + 1
        self.timing = self.timed and (following < ALWAYS_TIMED_STEPS or following % self.every == 0)

    def resolve(self, wait: bool = False) -> list[tuple[int, StepLink]]:
        """Read every ended step whose events are complete (all of them with ``wait``), oldest first."""
        done: list[tuple[int, StepLink]] = []
        while self._unresolved:
            pending = self._unresolved[0]
            if not self._step_complete(pending, wait):
                break
            self._unresolved.pop(0)
            done.append((pending.step, self._read(pending)))
        return done

    def _step_complete(self, pending: _Pending, wait: bool) -> bool:
        # Events of one stream complete in the order they were recorded, and a kind's starts share one stream, as
        # do its ends (d2h: the D2H stream; h2d: the H2D stream; stall: compute, then an H2D burst's done event of
        # this step, which is also the end of that burst's h2d span): the last start and the last end of each kind
        # stand for all of them (one query each instead of one per span, on the step's end). Stalls may wait on
        # bursts out of their recording order; the last h2d end covers every stall end. bound: compute, then a D2H
        # burst's done event, waited for oldest burst first.
        last: dict[tuple[str, int], Any] = {}
        for kind, start, end, _, _ in pending.spans:
            if start is not None:  # an untimed step has no starts: nothing to wait for
                last[kind, 0], last[kind, 1] = start, end
        return all(self._complete(event, wait) for event in last.values())

    def _complete(self, event: Any, wait: bool) -> bool:
        if event is None:
            return True
        if wait:
            event.synchronize()
            return True
        return bool(event.query())

    def _read(self, pending: _Pending) -> StepLink:
        link = StepLink()
        ms = {"d2h": 0.0, "h2d": 0.0, "stall": 0.0, "bound": 0.0}
        timed = False
        for kind, start, end, nbytes, keep_end in pending.spans:
            if kind == "d2h":
                link.d2h_bytes += nbytes
            elif kind == "h2d":
                link.h2d_bytes += nbytes
            else:
                link.waits += 1
            if start is not None and end is not None:
                # a stall span may end on the awaited copy's own event: a copy done before the compute stream
                # arrived is no stall (negative distance)
                ms[kind] += max(0.0, start.elapsed_time(end))
                timed = True
                self._free.append(start)
                if not keep_end:
                    self._free.append(end)
        if self.timed and (timed or not pending.spans):
            link.stall_ms = ms["stall"] + ms["bound"] if link.waits else 0.0
            link.bound_ms = ms["bound"]
            link.d2h_ms, link.h2d_ms = ms["d2h"], ms["h2d"]
            # bytes per ms / 1e6 = GB/s
            link.d2h_GBps = link.d2h_bytes / ms["d2h"] / 1e6 if link.d2h_bytes and ms["d2h"] > 0 else None
            link.h2d_GBps = link.h2d_bytes / ms["h2d"] / 1e6 if link.h2d_bytes and ms["h2d"] > 0 else None
        return link

    def clear(self) -> None:
        """Forget unread spans (abort paths, tests); pooled events stay reusable."""
        self._current = _Pending(step=self._current.step)
        self._unresolved.clear()
