"""Copy-out settings chosen by how far the host runs ahead of the GPU: one burst per layer with two in flight where
it runs ahead of a GPU-bound forward, two-layer bursts without a bound where it does not.

Why: in a GPU-bound step the host queues a whole forward before the GPU has run much of it, so at every layer it
looks, it sees no copy-out burst finished and hands no copied block back; without a bound they all go at the
forward's end (``Transport.release_copied``), and a peak inside the forward keeps them (session 84's B: Δpeak 750 of
1312 MiB). A bound on the bursts in flight lets the compute stream wait on the GPU for older bursts and free their
blocks at once. With the default two-layer bursts, aligned to the chunk's end, each pair starts a layer late, and a
link about 89 % busy never catches up: a stall of 12 ms a step and +2.4 % (session 85). With one burst per layer
nothing queues: session 86's B, the defaults +1.05 % [0.74, 1.45] with Δpeak 750 MiB, per-layer bursts with two in
flight +0.69 % [0.20, 1.20] with Δpeak 1150, stall 0.0 ms. Per-layer bursts cost a launch-bound step their CUDA
calls (A's attention set: +1.06 % over the defaults), where a host that runs ahead has time to spare.

Which case a run is can only be seen by running it, and the memory a job needs is its worst step's, so the first
``PROBE_STEPS`` training steps run with per-layer bursts and two in flight (a job's peak usually comes in its first
steps). The probe then reads two figures of the last of them. First, how much of what it copied out the compute
stream had to wait for: where the host runs ahead, it sees no burst finish and most bursts end in a wait; where it is
behind, it finds them finished, and only the last at each forward's end is waited for. Under ``PROBE_SHARE`` the
defaults come back at once. Second, once its GPU-timed figures are in (a step later), how long those waits took
(``StepLink.bound_ms``): a host that runs ahead while the link keeps up waits for nothing on the GPU; where the link
cannot keep up with the forward, the waits are step time, and the defaults come back for good, with the compute stream
waiting at each chunk's forward end for the copies still running there (``MCORE_OFFLOAD_FORWARD_END=wait``): copies
that trail the forward would otherwise still count at the peak after it, and the job's worst step would free less than
it offloads (session 83's A on a fast host: 750 of 1424 MiB in its worst step). A run the share sent back to the
defaults still switches where the host runs ahead in ``AHEAD_STEPS`` steps in a row (``summary.host_ran_ahead``: nearly
all a forward offloads still copying at its end).

Kept settings are judged by the telemetry the runtime keeps anyway: where the compute stream waits on the copy-out
bursts (``StepLink.bound_ms``) for more than ``REVERT_STALL_MIN_MS`` and ``REVERT_STALL_SHARE`` of a step's forward
and backward, on average over ``JUDGED_STEPS`` steps (a link that cannot keep up with the forward), the defaults come
back for good, with the forward-end wait as above and a warning. Nothing here synchronises with the GPU.

``MCORE_OFFLOAD_HOST_AHEAD=warn`` (default ``adapt``) runs the defaults throughout and only warns; a user who set
``MCORE_OFFLOAD_FLUSH_LAYERS``, ``MCORE_OFFLOAD_D2H_IN_FLIGHT`` or ``MCORE_OFFLOAD_FORWARD_END`` chose already, and
the runtime does not overrule that; nor with ``MCORE_OFFLOAD_COALESCE_RELOADS=1``, whose host buffers follow the
burst size; nor for ``offload_modules=["auto"]``, whose probes measure the defaults, until auto's plan is made.
"""

from __future__ import annotations

import logging
import os
from time import perf_counter_ns
from typing import Any

from mcore_offload.config import choice_env
from mcore_offload.summary import OffloadSummary, StepRecord, host_ran_ahead

logger = logging.getLogger(__name__)

HOST_AHEAD_VARIABLE = "MCORE_OFFLOAD_HOST_AHEAD"
#: variables that mean the user chose the copy-out settings: the runtime then leaves them alone
CHOSEN_BY_USER = ("MCORE_OFFLOAD_FLUSH_LAYERS", "MCORE_OFFLOAD_D2H_IN_FLIGHT", "MCORE_OFFLOAD_FORWARD_END")
COALESCE_VARIABLE = "MCORE_OFFLOAD_COALESCE_RELOADS"
ADAPTED_FLUSH_LAYERS = 1
ADAPTED_IN_FLIGHT = 2
# training steps run with the adapted settings before the probe decides; the first is a warm-up (pinned buffers are
# allocated in it), so the decision reads the last
PROBE_STEPS = 2
# the share of a step's copied-out bytes the compute stream waited for, at and above which the host ran ahead: with
# the host behind, only the bursts still running at each forward's end are waited for (one or two of a forward's).
# B's attention set read 0.97 (session 86) and 0.79 (session 87, on a slower host); A's attention set 0.67 on a fast
# host, where the link cannot keep up with the forward (the waits' own time sends it back), and 0.00 on a slow one;
# C's experts 0.00 on both. Session 86's 0.9 sent B's 0.79 to the defaults, at Δpeak 750 MiB until a later switch
PROBE_SHARE = 0.5
# steps the probe waits, past its last, for that step's GPU-timed waits; a transport without a clock never has them,
# and the share alone decides (the judge then never does)
PROBE_LINK_STEPS = 2
# a run on the defaults switches after this many host-ahead steps in a row. A single step is not a pattern: A's
# attention set on a fast host, where the link cannot keep up with the forward, had its whole forward trailing in 3
# of 50 steps, two of them in a row, and a two-step trigger switched it (session 86: 17 ms more stall a step)
AHEAD_STEPS = 4
# the kept settings are judged on this many timed steps (after the probe's warm-up step; steps 0-3 are always timed)
JUDGED_STEPS = 3
# ... and undone where the compute stream waited on copy-out bursts, on average, for more than this share of the
# step's forward and backward (its chunks' first start to its close, on the host) and this many ms; the probe's own
# step is held to the same margin. Session 86's A waited 12.6, 0.0 and 2.6 ms in steps 1-3 of about 330: the first
# alone is over 1 %, and so is the mean, 5.1; a median would have read 0
REVERT_STALL_SHARE = 0.01
REVERT_STALL_MIN_MS = 1.0


def host_ahead_mode() -> str:
    """``MCORE_OFFLOAD_HOST_AHEAD``: ``adapt`` (default) or ``warn`` (a bad value: one clear sentence)."""
    return choice_env(HOST_AHEAD_VARIABLE, "adapt", ("adapt", "warn"))


class HostAheadAdapter:
    """Chooses the copy-out settings per rank; the manager calls :meth:`chunk_started` and :meth:`step_closed`.

    ``state``: ``off`` (``warn`` mode, or the user chose the settings), ``probing`` (the first steps, adapted
    settings), ``watching`` (defaults), ``adapted`` (adapted settings, not yet judged), ``kept`` or ``reverted`` (the
    defaults with the forward-end wait; by the judge, or by the probe step's own copy-out waits: then ``adapted_at`` is
    None).
    """

    def __init__(self, mode: str | None = None, environ: Any = None) -> None:
        environ = os.environ if environ is None else environ
        self.chosen = [name for name in CHOSEN_BY_USER if name in environ]
        if environ.get(COALESCE_VARIABLE) == "1":
            # coalesced host buffers are sized by the copy-out burst: another burst size later in the run would
            # allocate pinned memory after the first steps
            self.chosen.append(COALESCE_VARIABLE)
        mode = host_ahead_mode() if mode is None else mode
        self.state = "probing" if mode == "adapt" and not self.chosen else "off"
        self.adapted_at: int | None = None  # the first step run with the settings kept after the probe or a switch
        self.judged_at: int | None = None
        self.probe_share: float | None = None  # what the probe read
        self.bound_ms: float | None = None  # the copy-out waits the judge (or the probe's wait check) read
        self._probed = 0
        self._ahead_run = 0
        self._probe_rec: StepRecord | None = None  # the probe's last step, once its share passed
        self._bound_seen = 0  # the transports' bound_bytes at the last step's close
        self._before: tuple[int, int] | None = None  # (flush_layers, d2h_in_flight) the adapted settings replaced
        self._step_t0: int | None = None  # perf_counter_ns() at the current step's first chunk start
        self.step_spans_ms: dict[int, float] = {}  # step -> its chunks' first start to its close, until judged

    @property
    def speaks_for_host_ahead(self) -> bool:
        """Whether the summary leaves the host-ahead case to this adapter: it switches itself, and it warns when it
        undoes a switch (the summary's advice would be the switch just undone)."""
        return self.state != "off"

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state, "adapted_at_step": self.adapted_at, "judged_at_step": self.judged_at,
                "probe_share": self.probe_share, "bound_ms": self.bound_ms, "chosen_by_user": list(self.chosen)}

    def chunk_started(self, manager: Any, transport: Any) -> None:
        """A training chunk's forward starts on ``transport``: the settings of the current state are on it."""
        if self._step_t0 is None:
            self._step_t0 = perf_counter_ns()
        if self.state == "probing" and manager.auto is not None:
            self.state = "watching"  # auto's probes measure the defaults; after its plan, the four-step switch
        if self.state in ("probing", "adapted", "kept"):
            self._apply(manager, [transport])
        elif self.state == "reverted":
            transport.wait_at_forward_end = True  # a transport made after the revert (see _revert)

    def step_closed(self, summary: OffloadSummary, manager: Any, transports: list[Any], planning: bool) -> None:
        """A training step's record was just appended to ``summary.steps`` (``planning``: auto still probes, and its
        probe steps differ on purpose: they neither start nor judge a switch)."""
        bound = sum(t.bound_bytes for t in transports)
        waited, self._bound_seen = bound - self._bound_seen, bound
        if self._step_t0 is not None:
            if self.state in ("probing", "adapted"):
                self.step_spans_ms[summary.steps[-1].step] = (perf_counter_ns() - self._step_t0) / 1e6
            self._step_t0 = None
        if self.state == "probing":
            self._probe(summary, waited, manager, transports)
        elif self.state == "watching" and not planning:
            self._watch(summary.steps[-1], manager, transports)
        elif self.state == "adapted":
            self._judge(summary, manager, transports)

    def _apply(self, manager: Any, transports: list[Any]) -> None:
        if self._before is None and transports:
            self._before = (manager.flush_layers, max(t.d2h_in_flight for t in transports))
        manager.flush_layers = ADAPTED_FLUSH_LAYERS
        for t in transports:
            t.d2h_in_flight = ADAPTED_IN_FLIGHT

    def _restore(self, manager: Any, transports: list[Any]) -> None:
        if self._before is not None:
            manager.flush_layers, in_flight = self._before
            for t in transports:
                t.d2h_in_flight = in_flight

    def _revert(self, manager: Any, transports: list[Any]) -> None:
        """The defaults, with the compute stream waiting at each forward's end for the copies still running: the link
        cannot keep up with the forward, so copies trail it, and without the wait they would still count at the peak
        that follows (the memory the user asked for, at the cost of the copies' remaining time)."""
        self.state = "reverted"
        self._restore(manager, transports)
        for t in transports:
            t.wait_at_forward_end = True

    def _probe(self, summary: OffloadSummary, waited: int, manager: Any, transports: list[Any]) -> None:
        rec = summary.steps[-1]
        if self._probe_rec is None:
            if rec.aborted:
                return
            self._probed += 1
            if self._probed < PROBE_STEPS:
                return
            copied = rec.total("offloaded")
            self.probe_share = waited / copied if copied else 0.0
            if self.probe_share < PROBE_SHARE:
                self.state = "watching"
                self._restore(manager, transports)
                logger.info("offload step %d: the compute stream had to wait for %.0f of the %.0f MiB copied out "
                            "(the host keeps up with the GPU): the default copy-out bursts from step %d", rec.step,
                            waited / 2**20, copied / 2**20, rec.step + 1)
                return
            self._probe_rec = rec
        self._time_next_step(transports)  # the probe step's figures come a step late; keep timing until they do
        probe, link = self._probe_rec, self._probe_rec.link
        if (link is None or link.bound_ms is None) and rec.step - probe.step < PROBE_LINK_STEPS:
            return
        bound_ms = None if link is None else link.bound_ms
        span_ms = self.step_spans_ms.get(probe.step, 0.0)
        margin = self._margin(span_ms)
        if bound_ms is not None and bound_ms > margin:
            self.bound_ms, self.judged_at = bound_ms, probe.step
            self.step_spans_ms.clear()
            self._revert(manager, transports)
            logger.info(
                "offload step %d: with one copy-out burst per layer and %d in flight the compute stream waited %.1f ms "
                "on the copies (more than %.1f ms of a %.0f ms forward and backward), so the link does not keep up "
                "with the forward: the default copy-out bursts from step %d, the compute stream waiting at each "
                "forward's end for the copies still running, so that they do not count at a peak after it",
                probe.step, ADAPTED_IN_FLIGHT, bound_ms, margin, span_ms, rec.step + 1)
            return
        self.state, self.adapted_at = "adapted", 0
        copied = probe.total("offloaded")
        logger.info(
            "offload step %d: the compute stream had to wait for %.0f of the %.0f MiB copied out (the host runs ahead "
            "of the GPU and sees no copy finish during a forward), %s ms on the GPU: keeping one copy-out burst per "
            "layer with at most %d in flight, as MCORE_OFFLOAD_FLUSH_LAYERS=%d MCORE_OFFLOAD_D2H_IN_FLIGHT=%d (%s=warn "
            "runs the defaults)", probe.step, self.probe_share * copied / 2**20, copied / 2**20,
            "untimed" if bound_ms is None else f"{bound_ms:.2f}", ADAPTED_IN_FLIGHT, ADAPTED_FLUSH_LAYERS,
            ADAPTED_IN_FLIGHT, HOST_AHEAD_VARIABLE)

    @staticmethod
    def _time_next_step(transports: list[Any]) -> None:
        """Time the next step on every transport with a clock, whatever MCORE_OFFLOAD_TELEMETRY_EVERY says."""
        for t in transports:
            t.telemetry.timing = t.telemetry.timed

    @staticmethod
    def _margin(span_ms: float) -> float:
        """The copy-out waits a step may take with the adapted settings kept (see ``REVERT_STALL_SHARE``)."""
        return max(REVERT_STALL_MIN_MS, REVERT_STALL_SHARE * span_ms)

    def _watch(self, rec: StepRecord, manager: Any, transports: list[Any]) -> None:
        self._ahead_run = self._ahead_run + 1 if not rec.aborted and host_ran_ahead(rec) else 0
        if self._ahead_run < AHEAD_STEPS or not transports:
            return
        self.state, self.adapted_at = "adapted", rec.step + 1
        self._apply(manager, transports)
        self._time_next_step(transports)  # every step until judged, not one in MCORE_OFFLOAD_TELEMETRY_EVERY
        released = rec.released_per_forward()
        logger.info(
            "offload step %d: the host ran ahead of the GPU in %d steps in a row (%.0f MiB still being copied at a "
            "forward's end, where a forward offloads %.0f MiB on average, so no copied block went back during the "
            "forward): from step %d, one copy-out burst per layer with at most %d in flight, as "
            "MCORE_OFFLOAD_FLUSH_LAYERS=%d MCORE_OFFLOAD_D2H_IN_FLIGHT=%d (%s=warn keeps the defaults)",
            rec.step, AHEAD_STEPS, rec.trailing_bytes / 2**20, released / 2**20, self.adapted_at, ADAPTED_IN_FLIGHT,
            ADAPTED_FLUSH_LAYERS, ADAPTED_IN_FLIGHT, HOST_AHEAD_VARIABLE)

    def _judge(self, summary: OffloadSummary, manager: Any, transports: list[Any]) -> None:
        """Once ``JUDGED_STEPS`` adapted steps have their link figures (usually a step late): keep the settings, or
        undo them where the compute stream waited on copy-out bursts longer than the margin."""
        timed = [r for r in summary.steps[max(self.adapted_at, 1):]
                 if not r.aborted and r.link is not None and r.link.bound_ms is not None][:JUDGED_STEPS]
        if len(timed) < JUDGED_STEPS:
            self._time_next_step(transports)
            return
        self.bound_ms = sum(r.link.bound_ms for r in timed) / len(timed)
        step_ms = sum(self.step_spans_ms.get(r.step, 0.0) for r in timed) / len(timed)
        self.judged_at = timed[-1].step
        self.step_spans_ms.clear()
        margin = self._margin(step_ms)
        if self.bound_ms <= margin:
            self.state = "kept"
            logger.info("offload: per-layer copy-out bursts kept after steps %d-%d: the compute stream waited %.2f ms "
                        "a step on them, on average", timed[0].step, timed[-1].step, self.bound_ms)
            return
        self._revert(manager, transports)
        logger.warning(
            "offload steps %d-%d: with one copy-out burst per layer and %d in flight the compute stream waited "
            "%.1f ms a step on the copies, on average (more than %.1f ms of a %.0f ms forward and backward), so the "
            "link does not keep up with the forward: the default copy-out bursts are back from step %d, the compute "
            "stream waiting at each forward's end for the copies still running, so that they do not count at a peak "
            "after it. If the step time grew, offload fewer points (under pipeline parallelism these waits can fall "
            "where the GPU waits for another stage anyway: compare with MCORE_OFFLOAD_HOST_AHEAD=warn)",
            timed[0].step, timed[-1].step,
            ADAPTED_IN_FLIGHT, self.bound_ms, margin, step_ms, summary.steps[-1].step + 1)
