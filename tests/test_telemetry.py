"""Link telemetry: spans read only once complete, per-step stall and throughput, events pooled."""

from __future__ import annotations

import pytest

from mcore_offload.runtime.telemetry import LinkTelemetry


class FakeEvent:
    """A timing event on a fake clock; ``done`` says whether the 'GPU' has passed it."""

    clock = 0.0

    def __init__(self) -> None:
        self.t, self.done, self.synced = None, False, 0

    def record(self, stream) -> None:
        self.t, self.done = FakeEvent.clock, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done, self.synced = True, self.synced + 1

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.t - self.t


def test_a_step_is_read_once_its_events_completed_and_events_are_reused():
    tel = LinkTelemetry(FakeEvent)
    FakeEvent.clock = 0.0
    a = tel.mark("d2h")
    FakeEvent.clock = 2.0  # 100 MB in 2 ms = 50 GB/s
    b = tel.mark("d2h")
    tel.span("d2h", a, b, 100_000_000)
    c = tel.mark("compute")
    FakeEvent.clock = 2.5
    d = tel.mark("compute")
    tel.span("stall", c, d)
    tel.end_step(0)
    assert tel.resolve() == []  # not complete: never waits by itself
    for e in (a, b, c, d):
        e.done = True
    [(step, link)] = tel.resolve()
    assert step == 0 and link.d2h_GBps == pytest.approx(50.0) and link.stall_ms == pytest.approx(0.5)
    assert link.h2d_GBps is None and link.waits == 1 and link.d2h_bytes == 100_000_000
    created = tel.events_created
    for _ in range(4):
        tel.mark("x")
    assert tel.events_created == created  # the four read events came back to the pool


def test_resolve_with_wait_synchronises_and_keeps_step_order():
    tel = LinkTelemetry(FakeEvent)
    for step in range(2):
        s, e = tel.mark("h2d"), tel.mark("h2d")
        tel.span("h2d", s, e, 10)
        tel.end_step(step)
    assert [s for s, _ in tel.resolve(wait=True)] == [0, 1]


def test_without_a_clock_only_bytes_are_counted():
    tel = LinkTelemetry(None)
    tel.span("d2h", tel.mark(None), tel.mark(None), 5)
    tel.end_step(0)
    [(_, link)] = tel.resolve()
    assert link.d2h_bytes == 5 and link.d2h_GBps is None and link.stall_ms is None


def test_a_callers_end_event_is_timed_but_never_pooled():
    """A copy burst's done event ends its span; readers still wait on it, so it must not be re-recorded."""
    tel = LinkTelemetry(FakeEvent)
    FakeEvent.clock = 0.0
    start = tel.mark("h2d")
    done = FakeEvent()
    FakeEvent.clock = 1.0
    done.record("h2d")
    tel.span("h2d", start, done, 40_000_000, keep_end=True)
    tel.end_step(0)
    start.done = done.done = True
    [(_, link)] = tel.resolve()
    assert link.h2d_GBps == pytest.approx(40.0)
    created = tel.events_created
    assert tel.mark("x") is start and tel.mark("y") is not done  # only the mark came back
    assert tel.events_created == created + 1


def test_a_stall_ends_on_the_awaited_copy_and_a_copy_done_before_the_wait_is_no_stall():
    """One mark where compute reaches the wait; the copy's done event ends the span; negative distance is 0."""
    tel = LinkTelemetry(FakeEvent)
    FakeEvent.clock = 0.0
    first_arrival = tel.mark("compute")  # compute reaches the first wait at 0.0 ...
    FakeEvent.clock = 3.0
    late_copy = FakeEvent()
    late_copy.record("h2d")  # ... and its copy finishes at 3.0: 3 ms of stall
    tel.span("stall", first_arrival, late_copy, keep_end=True)
    FakeEvent.clock = 5.0
    early_copy = FakeEvent()
    early_copy.record("h2d")
    FakeEvent.clock = 6.0
    second_arrival = tel.mark("compute")  # this copy finished 1 ms before compute got there: no stall
    tel.span("stall", second_arrival, early_copy, keep_end=True)
    tel.end_step(0)
    for e in (first_arrival, late_copy, early_copy):
        e.done = True
    assert tel.resolve() == []  # the compute stream has not passed its last mark yet
    second_arrival.done = True
    [(_, link)] = tel.resolve()
    assert link.waits == 2 and link.stall_ms == pytest.approx(3.0)


def test_timing_is_sampled_by_step_and_untimed_steps_count_bytes_only():
    tel = LinkTelemetry(FakeEvent, every=3)
    timed = []
    for step in range(10):
        timed.append(tel.timing)
        start = tel.mark("d2h")
        FakeEvent.clock += 1.0
        done = FakeEvent()  # the burst's own done event (the transport's), recorded whatever the sampling
        done.record("d2h")
        done.done = True
        if start is not None:
            start.done = True
        tel.span("d2h", start, done, 1_000_000, keep_end=True)
        tel.end_step(step)
    assert timed == [True] * 4 + [False, False, True, False, False, True]  # steps 0-3, then every 3rd
    links = dict(tel.resolve())
    assert [links[s].d2h_GBps is not None for s in range(10)] == timed
    assert all(links[s].d2h_bytes == 1_000_000 for s in range(10))
    assert links[4].stall_ms is None and links[6].d2h_GBps == pytest.approx(1.0)


def test_a_bad_sampling_setting_is_one_clear_sentence(monkeypatch):
    monkeypatch.setenv("MCORE_OFFLOAD_TELEMETRY_EVERY", "0")
    with pytest.raises(ValueError, match="MCORE_OFFLOAD_TELEMETRY_EVERY='0' is not a positive integer"):
        LinkTelemetry(FakeEvent)
    monkeypatch.setenv("MCORE_OFFLOAD_TELEMETRY_EVERY", "1")
    tel = LinkTelemetry(FakeEvent)
    for step in range(6):
        assert tel.timing
        tel.end_step(step)


def test_copies_the_step_cannot_hide_are_warned_about_once_per_rank(caplog):
    """A stall over a quarter of the step (and over 10 ms) says the link cannot hide the bytes: one warning that says
    what to do; stalls like D-moe's (33 ms of a 944 ms step, 115 ms under the copy-out bound), a first step with no
    interval, and later steps are quiet."""
    from mcore_offload.runtime.telemetry import StepLink
    from mcore_offload.summary import OffloadSummary, StepRecord

    summary = OffloadSummary()

    def step(n, stall, host_ms):
        return StepRecord(n, False, {}, host_step_ms=host_ms,
                          link=StepLink(stall_ms=stall, d2h_bytes=19712 * 2**20, h2d_bytes=19712 * 2**20))

    with caplog.at_level("WARNING", logger="mcore_offload.summary"):
        assert not summary.warn_if_copies_exposed(step(0, 507.0, None))  # no interval before the first step
        assert not summary.warn_if_copies_exposed(step(1, 33.0, 944.0))
        assert not summary.warn_if_copies_exposed(step(1, 115.0, 944.0))
        assert not summary.warn_if_copies_exposed(step(2, 9.0, 50.0))  # a large share, but under 10 ms
        assert summary.warn_if_copies_exposed(step(3, 612.0, 812.0))
        assert not summary.warn_if_copies_exposed(step(4, 612.0, 812.0))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["offload step 3: the compute stream waited 612 ms on the copies, 75 % of the step, so the "
                        "link cannot move these 19712 MiB out and back under this step's compute: offload fewer "
                        "points (the largest per point are in the summary table) or let offload_modules=['auto'] "
                        "choose"]


def test_each_recorded_step_carries_the_host_time_since_the_previous_one():
    from mcore_offload.summary import OffloadSummary

    summary = OffloadSummary()
    summary.close_step()
    summary.close_step()
    first, second = summary.steps
    assert first.host_step_ms is None and second.host_step_ms is not None and second.host_step_ms >= 0
