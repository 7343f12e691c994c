"""What the runtime does when the host runs ahead of a GPU-bound forward: one copy-out burst per layer, two in flight.

Why: in a GPU-bound step the host queues a whole forward before the GPU has run much of it, so at every layer it
looks, it sees no copy-out burst finished and hands no copied block back; they all go at the forward's end
(``Transport.release_copied``), and a peak inside the forward keeps them (session 84's B: Δpeak 750 of 1312 MiB). A
bound on the bursts in flight lets the compute stream wait on the GPU for older bursts and free their blocks at
once, but with the default two-layer bursts, aligned to the chunk's end, each pair starts a layer late, and a link
about 89 % busy never catches up: about 2.8 ms of copying was left at each forward's end, a stall of 12 ms a step
and +2.4 % (session 85). With one burst per layer nothing queues: session 86's B, 100 steps each, alternating with
plain steps in one process, the defaults +1.05 % [0.74, 1.45] with Δpeak 750 MiB, per-layer bursts with two in
flight +0.69 % [0.20, 1.20] with Δpeak 1150, stall 0.0 ms. Per-layer bursts cost a launch-bound step their CUDA calls
(A's attention set: +1.06 % over the defaults), but a host that runs ahead has time to spare, so the switch is made
only where the steps say so: the host ran ahead in ``AHEAD_STEPS`` steps in a row (``summary.host_ran_ahead``).

The switch is judged afterwards by the telemetry the runtime keeps anyway (every step timed until then, a step late):
if the compute stream waits on the copies noticeably longer than before (a link that cannot keep up with the
forward), the earlier settings come back and a warning says what that leaves on the device. Nothing here
synchronises with the GPU.

``MCORE_OFFLOAD_HOST_AHEAD=warn`` (default ``adapt``) keeps the settings and only warns; a user who set
``MCORE_OFFLOAD_FLUSH_LAYERS``, ``MCORE_OFFLOAD_D2H_IN_FLIGHT`` or ``MCORE_OFFLOAD_FORWARD_END`` chose already, and
the runtime does not overrule that.
"""

from __future__ import annotations

import logging
import os
import statistics
from typing import Any

from mcore_offload.config import choice_env
from mcore_offload.summary import OffloadSummary, StepRecord, host_ran_ahead

logger = logging.getLogger(__name__)

HOST_AHEAD_VARIABLE = "MCORE_OFFLOAD_HOST_AHEAD"
#: variables that mean the user chose the copy-out settings: the runtime then leaves them alone
CHOSEN_BY_USER = ("MCORE_OFFLOAD_FLUSH_LAYERS", "MCORE_OFFLOAD_D2H_IN_FLIGHT", "MCORE_OFFLOAD_FORWARD_END")
ADAPTED_FLUSH_LAYERS = 1
ADAPTED_IN_FLIGHT = 2
# a single step is not a pattern: this many in a row. B's host ran ahead in every step; A's attention set on a fast
# host, where the link cannot keep up with the forward, had its whole forward trailing in 3 of 50 steps, two of them
# in a row, and switched at two (session 86, lease 2: the stall grew by 17 ms a step until it was undone)
AHEAD_STEPS = 4
# after the switch, this many steps' stalls are compared with the stall before it ...
JUDGED_STEPS = 2
# ... and the switch is undone where the stall grew by more than this share of the step and this many ms
REVERT_STALL_SHARE = 0.01
REVERT_STALL_MIN_MS = 1.0


def host_ahead_mode() -> str:
    """``MCORE_OFFLOAD_HOST_AHEAD``: ``adapt`` (default) or ``warn`` (a bad value: one clear sentence)."""
    return choice_env(HOST_AHEAD_VARIABLE, "adapt", ("adapt", "warn"))


class HostAheadAdapter:
    """Watches each closed step; switches the copy-out settings once where the host runs ahead, and judges it.

    ``state``: ``off`` (``warn`` mode, or the user chose the settings), ``watching``, ``adapted`` (switched, not yet
    judged), ``kept`` or ``reverted``. The manager calls :meth:`step_closed` after each training step's record.
    """

    def __init__(self, mode: str | None = None, environ: Any = None) -> None:
        environ = os.environ if environ is None else environ
        self.chosen = [name for name in CHOSEN_BY_USER if name in environ]
        mode = host_ahead_mode() if mode is None else mode
        self.state = "watching" if mode == "adapt" and not self.chosen else "off"
        self.adapted_at: int | None = None  # the first step run with the switched settings
        self.judged_at: int | None = None
        self._ahead_run = 0
        self._before: tuple[int, int] | None = None  # (flush_layers, d2h_in_flight) the switch replaced
        self._stalls: tuple[float, float] | None = None  # (before, after) medians, once judged

    @property
    def speaks_for_host_ahead(self) -> bool:
        """Whether the summary leaves the host-ahead case to this adapter: it logs its own line when it switches,
        and its own warning when it undoes the switch (the summary's advice would be the switch just undone)."""
        return self.state != "off"

    def as_dict(self) -> dict[str, Any]:
        before, after = self._stalls if self._stalls is not None else (None, None)
        return {"state": self.state, "adapted_at_step": self.adapted_at, "judged_at_step": self.judged_at,
                "stall_ms_before": before, "stall_ms_after": after, "chosen_by_user": list(self.chosen)}

    def step_closed(self, summary: OffloadSummary, manager: Any, transports: list[Any], planning: bool) -> None:
        """A training step's record was just appended to ``summary.steps`` (``planning``: auto still probes, and its
        probe steps differ on purpose: they neither start nor judge a switch)."""
        if self.state == "watching" and not planning:
            self._watch(summary, manager, transports)
        elif self.state in ("adapted", "kept"):
            self._apply(manager, transports)  # a transport made since (a device first used now) gets it too
            if self.state == "adapted":
                self._judge(summary, manager, transports)

    def _watch(self, summary: OffloadSummary, manager: Any, transports: list[Any]) -> None:
        rec = summary.steps[-1]
        self._ahead_run = self._ahead_run + 1 if not rec.aborted and host_ran_ahead(rec) else 0
        if self._ahead_run < AHEAD_STEPS or not transports:
            return
        self._before = (manager.flush_layers, max(t.d2h_in_flight for t in transports))
        self.state, self.adapted_at = "adapted", rec.step + 1
        self._apply(manager, transports)
        released = rec.total("released_in_forward") / max(rec.forward_ends, 1)
        logger.info(
            "offload step %d: the host ran ahead of the GPU in %d steps in a row (%.0f of the %.0f MiB a forward "
            "offloads still being copied at its end, so no copied block went back during the forward): from step %d, "
            "one copy-out burst per layer with at most %d in flight, as MCORE_OFFLOAD_FLUSH_LAYERS=%d "
            "MCORE_OFFLOAD_D2H_IN_FLIGHT=%d (%s=warn keeps the settings)", rec.step, AHEAD_STEPS,
            rec.trailing_bytes / 2**20, released / 2**20, self.adapted_at, ADAPTED_IN_FLIGHT,
            ADAPTED_FLUSH_LAYERS, ADAPTED_IN_FLIGHT, HOST_AHEAD_VARIABLE)

    def _apply(self, manager: Any, transports: list[Any]) -> None:
        manager.flush_layers = ADAPTED_FLUSH_LAYERS
        for t in transports:
            t.d2h_in_flight = ADAPTED_IN_FLIGHT
            if self.state == "adapted":  # time every step until judged, not one in MCORE_OFFLOAD_TELEMETRY_EVERY
                t.telemetry.timing = t.telemetry.timed

    def _judge(self, summary: OffloadSummary, manager: Any, transports: list[Any]) -> None:
        """Once ``JUDGED_STEPS`` switched steps have their link figures (usually a step late): keep the switch, or
        undo it where the compute stream waited on the copies longer by more than the margin."""
        after = _timed(summary.steps[self.adapted_at:])
        if len(after) < JUDGED_STEPS:
            return
        after = after[:JUDGED_STEPS]
        before = _timed(summary.steps[1:self.adapted_at]) or _timed(summary.steps[:self.adapted_at])
        stall_before = statistics.median(r.link.stall_ms for r in before) if before else 0.0
        stall_after = statistics.median(r.link.stall_ms for r in after)
        step_ms = statistics.median(r.host_step_ms or 0.0 for r in after)
        self._stalls, self.judged_at = (stall_before, stall_after), after[-1].step
        margin = max(REVERT_STALL_MIN_MS, REVERT_STALL_SHARE * step_ms)
        if stall_after - stall_before <= margin:
            self.state = "kept"
            logger.info("offload: per-layer copy-out bursts kept after steps %d-%d: stall %.2f ms a step against "
                        "%.2f ms before", after[0].step, after[-1].step, stall_after, stall_before)
            return
        self.state = "reverted"
        manager.flush_layers, in_flight = self._before
        for t in transports:
            t.d2h_in_flight = in_flight
        logger.warning(
            "offload steps %d-%d: with one copy-out burst per layer and %d in flight the compute stream waited "
            "%.1f ms a step on the copies against %.1f ms before (more than %.1f ms of a %.0f ms step), so the link "
            "does not keep up with the forward: the earlier settings are back from step %d, and copies still running "
            "at a forward's end stay allocated at a peak there. Offload fewer points, or set "
            "MCORE_OFFLOAD_D2H_IN_FLIGHT yourself to trade step time for memory", after[0].step, after[-1].step,
            ADAPTED_IN_FLIGHT, stall_after, stall_before, margin, step_ms, summary.steps[-1].step + 1)


def _timed(records: list[StepRecord]) -> list[StepRecord]:
    """The records with a GPU-timed stall, unaborted."""
    return [r for r in records if not r.aborted and r.link is not None and r.link.stall_ms is not None]
