"""``auto`` chooses for the peak the step would reach without offloading (runtime/peak_trace.py): the trace itself,
how the summary records it, and what the choice and the planner do with it."""

from __future__ import annotations

import json
import logging
import math

import pytest

from mcore_offload.runtime import manager as manager_module
from mcore_offload.runtime.auto import PROBE_STEPS, AutoPlanner
from mcore_offload.runtime.auto_choice import ChunkProfile, HostCost, choose
from mcore_offload.runtime.manager import get_manager
from mcore_offload.runtime.peak_trace import PeakFollower, PeakTrace
from mcore_offload.summary import get_summary
from tests.harness.gpt import init_parallel
from tests.test_auto import CA, MiB, _Mark, pytestmark, train_auto_bitwise_equal  # noqa: F401 (warning filters)
from tests.test_auto_record import auto_replay


def test_a_trace_is_the_allocators_peak_plus_the_bytes_off_per_interval_and_follows_what_is_taken():
    trace = PeakTrace()
    trace.add(100, 0, None)
    trace.add(80, 40, {"a": 30, "b": 10})  # plain 120: a and b off
    trace.add(90, 25, {"a": 0, "c": 25})  # plain 115: only c (a is back)
    assert trace.plain == [100, 120, 115] and trace.off == [{}, {"a": 30, "b": 10}, {"c": 25}]
    assert trace.plain_peak == 120 and trace.keys() == {"a", "b", "c"}
    # taking a lowers only its interval: the peak moves to the third
    assert trace.residual({"a"}) == [100, 90, 115] and trace.saving({"a"}) == 5
    assert trace.saving({"a", "c"}) == 20  # now the first interval (nothing off) holds the peak
    merged = trace.regroup(lambda k: None if k == "b" else "x")
    assert merged.plain == trace.plain and merged.off == [{}, {"x": 30}, {"x": 25}]


def test_an_interval_under_the_allocators_own_peak_is_never_kept():
    """No plan goes below the allocator's peak with everything offloaded, so an interval whose plain peak is under
    it can never be the peak: dropped as it comes, or at a compaction once the floor has risen above it."""
    trace = PeakTrace()
    trace.add(50, 10, {"a": 10})  # plain 60, floor 50: kept for now
    trace.add(100, 0, None)  # floor 100
    trace.add(70, 20, {"a": 20})  # plain 90 < 100: dropped at once
    assert trace.plain == [60, 100] and trace.floor == 100
    trace.compact()
    assert trace.plain == [100] and trace.off == [{}]
    for i in range(200):  # a long step compacts on its own: memory stays near what can still be the peak
        trace.add(100 + i, 5, {"b": 5})
    assert len(trace.plain) < 140 and trace.plain_peak == 304 and trace.saving({"b"}) == 5
    trace.compact()
    assert trace.plain == [299, 300, 301, 302, 303, 304]  # allocator peaks 294-299 plus the 5 off


def test_the_follower_reads_a_keys_bytes_where_the_step_peaks_after_each_pick():
    trace = PeakTrace([120, 115, 100], [{"a": 30, "b": 10}, {"c": 25}, {}])
    f = PeakFollower(trace)
    assert (f.at_peak("a"), f.at_peak("c")) == (30, 0)
    f.take("a")  # 90 / 115 / 100: the second interval is the highest now
    assert (f.at_peak("a"), f.at_peak("c")) == (0, 25)
    assert PeakFollower(PeakTrace()).at_peak("a") == 0


def test_the_summary_resets_the_statistic_at_each_event_and_keeps_every_interval():
    summary = type(get_summary())()
    allocator = {"peak": 100}
    resets = []

    def reset() -> None:
        resets.append(allocator["peak"])
        allocator["peak"] = allocator.get("now", allocator["peak"])

    summary.track_peak(lambda: allocator["peak"], by_key=True, reset_peak=reset)
    allocator.update(peak=150, now=110)  # the first interval peaks at 150 with nothing off
    summary.off_device(+40, ("v", 1, "core_attn"))
    allocator.update(peak=130, now=70)  # 130 + 40 off: the plain step would have held 170 here
    summary.off_device(+20, ("v", 2, "core_attn"))
    allocator.update(peak=90)  # 90 + 60 = 150
    assert summary.peak_so_far() == 150  # the statistic alone now reads its interval's 90
    summary.stop_tracking_peak()
    trace = summary.peak_trace
    assert trace.plain == [150, 170, 150]
    assert trace.off == [{}, {("v", 1, "core_attn"): 40}, {("v", 1, "core_attn"): 40, ("v", 2, "core_attn"): 20}]
    assert summary.traced_peak_bytes == 150 and len(resets) == 3
    assert summary.off_by_key_at_peak == {}  # the probe's own peak (150) came first, with nothing off
    # without a reset function nothing is traced per interval (the benchmark's step-1 peak attribution)
    plain = type(get_summary())()
    plain.track_peak(lambda: 5)
    plain.off_device(+1, None)
    assert plain.peak_trace is None


def _chunk(layers: int) -> ChunkProfile:
    p = ChunkProfile(layer_ms={i: 5.0 for i in range(1, layers + 1)}, tail_ms=5.0)
    p.unit_bytes = {(i, CA): 40 * MiB for i in range(1, layers + 1)}
    return p


def test_the_choice_takes_what_is_off_where_the_plain_step_peaks_not_where_the_probe_did():
    """Session 69's D-moe rank 0: with everything offloaded the probe peaked with the last layer off; the plain step
    peaks earlier, with layers 1 and 2 off; the plan must take those."""
    trace = PeakTrace(
        plain=[6000 * MiB, 4100 * MiB],
        off=[{(0, 1, CA): 160 * MiB, (0, 2, CA): 160 * MiB}, {(0, 4, CA): 120 * MiB}])
    host = HostCost(exposure=1.0, group_ms=1.0, budget_ms=8.0, microbatches={0: 4})  # two units fit
    plan = choose({0: _chunk(4)}, link_GBps=1000.0, host=host, trace=trace)
    assert {k for k, v in plan.points.items() if v} == {(0, 1), (0, 2)}
    assert plan.expected_saving_bytes == 320 * MiB
    # the probe's own peak attribution (the old input) would have picked layer 4 and saved nothing
    old = _chunk(4)
    old.peak_bytes = {(4, CA): 120 * MiB}
    assert {k for k, v in choose({0: old}, link_GBps=1000.0, host=host).points.items() if v} == {(0, 4)}
    assert trace.saving([(0, 4, CA)]) == 0


def test_once_the_peak_moves_the_choice_follows_it_and_expects_only_what_the_new_peak_allows():
    trace = PeakTrace(plain=[1000 * MiB, 950 * MiB], off=[{(0, 1, CA): 200 * MiB}, {(0, 2, CA): 100 * MiB}])
    plan = choose({0: _chunk(2)}, link_GBps=1000.0, trace=trace)
    # layer 1 lowers the first interval to 800; the second (950) is then the peak, and layer 2 lowers it to 850
    assert {k for k, v in plan.points.items() if v} == {(0, 1), (0, 2)}
    assert plan.expected_saving_bytes == 150 * MiB
    # nothing off where the plain step peaks: no unit can lower it, and the plan says so
    flat = PeakTrace(plain=[1000 * MiB, 900 * MiB], off=[{}, {(0, 1, CA): 200 * MiB}])
    empty = choose({0: _chunk(2)}, link_GBps=1000.0, trace=flat)
    assert not any(empty.points.values()) and "would not lower it" in empty.describe()


def test_a_target_is_measured_against_the_plain_peak():
    trace = PeakTrace(plain=[1000 * MiB, 990 * MiB],
                      off=[{(0, 1, CA): 300 * MiB, (0, 2, CA): 300 * MiB}, {(0, 3, CA): 200 * MiB}])
    # 100 MiB needed (x1.05): one unit of the first interval brings it to 700, but the second (990) is then the peak,
    # 10 MiB under the first: the choice keeps layer 3 too, and needs neither of the first interval's other units
    plan = choose({0: _chunk(3)}, link_GBps=1000.0, need_bytes=100 * MiB, trace=trace)
    assert {k for k, v in plan.points.items() if v} == {(0, 2), (0, 3)}
    assert plan.expected_saving_bytes == 210 * MiB
    # a target beyond what the second interval allows is reported as unreachable
    far = choose({0: _chunk(3)}, link_GBps=1000.0, need_bytes=400 * MiB, trace=trace)
    assert "target not reachable" in far.describe()


def test_the_planner_plans_for_the_trace_and_logs_the_plain_peak(caplog: pytest.LogCaptureFixture):
    planner = AutoPlanner(None)
    clocks = lambda a, b: 1.0  # noqa: E731
    plan = None
    with caplog.at_level(logging.INFO, logger="mcore_offload.runtime.auto"):
        for _ in range(PROBE_STEPS):
            if planner.measuring:
                planner.chunk_started(0)
                planner._probe_t0 -= 1.0
                for _ in range(3):
                    planner._marks[-1].layer_started(_Mark(False))  # the GPU's queue hides host time
                for layer in (1, 2, 3):
                    planner.offloaded(0, 0, layer, "core_attn", 8 * MiB)
                planner.step_ended(clocks, 50.0, None, 0, runtime_ms=1.0)
            elif planner.tracing_peak:
                trace = PeakTrace([900 * MiB, 700 * MiB],
                                  [{(0, 2, "core_attn"): 8 * MiB, (0, 2, "attn_proj"): 2 * MiB, (5, 1, "x"): 1},
                                   {(0, 3, "core_attn"): 8 * MiB}])
                plan = planner.step_ended(clocks, None, 700 * MiB, 8 * MiB, off_at_peak={(0, 3, "core_attn"): 8 * MiB},
                                          trace=trace)
            else:
                planner.step_ended(clocks, None, None, 0)
    assert plan is planner.plan and {k for k, v in plan.points.items() if v} == {(0, 2)}
    assert plan.expected_saving_bytes == 10 * MiB  # core_attn and attn_proj are one unit; chunk 5 is not this rank's
    assert "would peak at 0.88 GiB" in caplog.text and "the probe itself peaked at 0.68 GiB" in caplog.text


@pytest.fixture(scope="module")
def _parallel():
    init_parallel()


def test_a_real_model_plans_for_the_traced_plain_peak_bitwise_equal(_parallel, caplog, monkeypatch):
    """The manager's peak step with an allocator statistic (a stand-in on the CPU: it reads 0, so each interval's
    plain peak is its bytes off the device): every interval is kept, the reloads go through the path that counts them
    back first, the plan follows the trace, and the numbers stay bitwise equal."""
    resets = []
    monkeypatch.setattr(manager_module, "peak_statistics", lambda device: (lambda: 0, lambda: resets.append(1)))
    counted_first = []  # reload bursts of the traced step: how many entries came back on the device before to_device
    before_reload = manager_module.OffloadManager.before_reload

    def recording(self, entries):
        tracing, off = self.summary.traces_plain_peak, sum(e.off_device for e in entries)
        before_reload(self, entries)
        if tracing:
            counted_first.append((off, sum(e.off_device for e in entries)))

    monkeypatch.setattr(manager_module.OffloadManager, "before_reload", recording)
    train_auto_bitwise_equal(caplog)
    assert "without offloading the traced step would peak at" in caplog.text and len(resets) > 2
    # the traced step's reloads (the Python path, with or without the C++ runtime loaded) counted their entries back
    # before allocating them; no other step did
    assert counted_first and all(off > 0 and after == 0 for off, after in counted_first)
    plan = get_manager().auto.plan
    # the plain peak here is the moment with the most bytes off: the end of the forward, where every offloaded
    # layer is off; the plan expects to take all of it away (the stand-in allocator holds nothing else)
    assert plan is not None and plan.expected_saving_bytes > 0 and any(plan.points.values())
    steps = get_summary().steps
    for step in steps[PROBE_STEPS:]:
        assert step.total("released_in_forward") == step.total("offloaded") == step.total("reloaded") > 0
    assert get_summary().off_device_bytes == 0 and get_summary().peak_trace is None
    # what the plan was chosen from is kept, JSON-ready, and replays to the same plan (benchmarks/auto_replay.py)
    record = json.loads(json.dumps(get_manager().auto.record))
    replayed = auto_replay.replay(record, [1.0, math.inf])
    assert replayed["replay_matches"] and record["trace"] is not None
    assert replayed["full_set_saving_bytes"] >= plan.expected_saving_bytes
