"""``offload_modules=["auto"]``: spelling, the choice on synthetic measurements, and a real run on CPU."""

from __future__ import annotations

import logging

import pytest

from mcore_offload.config import validate_offload_modules
from mcore_offload.runtime import auto_choice
from mcore_offload.runtime.auto import (
    OUTSIDE_CLOCK_VARIABLE,
    PROBE_STEPS,
    AutoPlanner,
    ChunkMarks,
    caught_up_by_layer,
    parse_auto,
)
from mcore_offload.runtime.auto_choice import (
    HOST_BUDGET,
    JOINED_UNIT_COST,
    OUTSIDE_CLOCK,
    TRAFFIC_SHARE_PER_GIB,
    ChunkProfile,
    HostCost,
    choose,
    host_cost,
)
from mcore_offload.runtime.manager import get_manager, reset
from mcore_offload.summary import get_summary
from tests.harness.gpt import build_dense_gpt, build_moe_gpt, init_parallel, run_steps

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
MiB = 2**20
CA = ("core_attn", "attn_proj")


def test_spelling():
    assert parse_auto(["core_attn"]) is False
    assert parse_auto(["auto"]) is None
    assert parse_auto(["auto:38.5"]) == 38.5
    assert validate_offload_modules(["auto:12"]) == ["auto:12"]
    with pytest.raises(ValueError, match="mixes 'auto' with other names"):
        parse_auto(["auto", "core_attn"])
    for bad in (["auto:"], ["auto:-3"], ["auto:lots"]):
        with pytest.raises(ValueError, match=r"is not 'auto:<GiB>' with a positive number; write e\.g\. 'auto:38\.5'"):
            validate_offload_modules(bad)


def profile(layers: int, layer_ms: float, per_layer: dict[tuple[str, ...], int], live: int = 1) -> ChunkProfile:
    p = ChunkProfile(layer_ms={i: layer_ms for i in range(1, layers + 1)}, tail_ms=layer_ms, live_at_peak=live)
    p.unit_bytes = {(i, u): n for i in range(1, layers + 1) for u, n in per_layer.items()}
    return p


def test_everything_is_chosen_when_the_link_keeps_up():
    # 1 ms layers at 50 GB/s (x0.9): 45 MB per layer fit; 30 + 10 MB per layer do
    prof = profile(4, 1.0, {CA: 30_000_000, ("qkv_linear",): 10_000_000})
    plan = choose({None: prof}, link_GBps=50.0)
    assert plan.hidden and all(plan.points[(None, i)] == {"core_attn", "attn_proj", "qkv_linear"} for i in range(1, 5))
    assert plan.expected_saving_bytes == 4 * 40_000_000


def test_the_largest_units_are_kept_and_the_rest_left_when_the_link_cannot_keep_up():
    # 40 MB + 30 MB per 1 ms layer need 70 GB/s: every layer keeps its 40 MB core attention, the queue
    # then has room for only some qkv_linear groups (a layer of lag is allowed), never all of them.
    prof = profile(6, 1.0, {CA: 40_000_000, ("qkv_linear",): 30_000_000})
    plan = choose({None: prof}, link_GBps=50.0)
    assert all(set(CA) <= plan.points[(None, i)] for i in range(1, 7))
    qkv = sum("qkv_linear" in plan.points[(None, i)] for i in range(1, 7))
    assert 0 < qkv < 6
    assert plan.hidden


def test_a_target_takes_just_enough_largest_first_and_counts_microbatches_in_flight():
    prof = profile(4, 1.0, {CA: 30 * MiB, ("qkv_linear",): 10 * MiB}, live=2)
    plan = choose({None: prof}, link_GBps=1000.0, need_bytes=100 * MiB)  # 2 x 30 MiB per core-attn group
    chosen = [(k, v) for k, v in plan.points.items() if v]
    assert all(v == frozenset(CA) for _, v in chosen) and len(chosen) == 2
    assert plan.expected_saving_bytes == 2 * 2 * 30 * MiB
    assert not choose({None: prof}, 1000.0, need_bytes=0).points


def test_groups_kept_on_the_device_stay_in_the_plan_so_that_backward_prefetches_early():
    prof = profile(3, 1.0, {CA: 10 * MiB})
    del prof.unit_bytes[(3, CA)]
    prof.kept = {(3, CA)}  # the last layer: its backward starts the reload of layer 2
    plan = choose({None: prof}, link_GBps=1000.0)
    assert plan.points[(None, 3)] == frozenset(CA) and plan.expected_saving_bytes == 2 * 10 * MiB
    # the plan line says nothing of layer 3 moves (on the local spec, session 80, its core_attn read as offloaded)
    assert plan.kept == {(None, 3)}
    assert "L2:" in plan.describe() and "L3(kept on the device):" in plan.describe()


def test_an_unreachable_target_offloads_everything_and_says_so():
    prof = profile(2, 1.0, {CA: 10 * MiB})
    plan = choose({None: prof}, link_GBps=1000.0, need_bytes=1024 * MiB)
    assert len([v for v in plan.points.values() if v]) == 2
    assert "target not reachable" in plan.describe()


def test_a_target_beyond_the_hidden_set_adds_exposed_copies():
    prof = profile(4, 1.0, {CA: 40_000_000, ("qkv_linear",): 30_000_000})
    hidden = choose({None: prof}, 50.0)
    plan = choose({None: prof}, 50.0, need_bytes=int((hidden.expected_saving_bytes + 50_000_000) / 1.05))
    assert not plan.hidden and plan.expected_saving_bytes > hidden.expected_saving_bytes
    # the line names what the model checked (no host budget on this plan), never a measured "hidden"
    assert plan.describe().endswith("copies beyond the modelled link")
    assert hidden.describe().endswith("copies within the modelled link") and "hidden" not in hidden.describe()


QKV = ("qkv_linear",)


def launch_bound(exposure: float, group_ms: float, budget_ms: float, microbatches: int = 4) -> HostCost:
    return HostCost(exposure=exposure, group_ms=group_ms, budget_ms=budget_ms, microbatches={None: microbatches})


def test_a_launch_bound_step_gets_the_most_bytes_its_host_budget_buys_next_to_the_turnaround():
    # 8 layers (the last kept on the device), 1 ms of host per group and microbatch, 4 microbatches, 10 ms budget:
    # the kept layer costs 0.4 x 4 = 1.6 ms; a layer's core attention 4 ms, its qkv_linear joining it 1.6 ms
    prof = profile(8, 5.0, {CA: 40 * MiB, QKV: 30 * MiB})
    for u in (CA, QKV):
        del prof.unit_bytes[(8, u)]
    prof.kept = {(8, CA), (8, QKV)}
    plan = choose({None: prof}, link_GBps=1000.0, host=launch_bound(1.0, 1.0, 10.0))
    # 1.6 + 1.6 (kept) + 4 + 1.6 (layer 7) = 8.8 ms; layer 6's core attention would need 4 more
    assert {k: set(v) for k, v in plan.points.items() if v} == {(None, 8): {*CA, *QKV}, (None, 7): {*CA, *QKV}}
    assert plan.host_ms == pytest.approx(8.8) and plan.host_ms <= 10.0 and plan.hidden
    assert plan.expected_saving_bytes == 70 * MiB
    assert "host time 8.8 of 10.0 ms/step budget" in plan.describe()
    assert "copies within the modelled link and host budget" in plan.describe()


def test_under_pp_a_unit_that_is_back_on_the_device_at_the_traced_peak_is_never_chosen():
    """Two chunks that do not turn around (PP): the probe's trace says each chunk's last layer was back on the
    device at the peak (2x H200, session 15: the plan that took those layers saved 0 MiB on rank 0)."""
    profiles = {}
    for vp in (0, 1):
        prof = profile(4, 5.0, {CA: 40 * MiB})
        # layers 1-3 off in 5 and 4 microbatches at the peak; layer 4 reloaded as the chunk's backward started
        prof.peak_bytes = {(i, CA): (5 - vp) * 40 * MiB for i in range(1, 4)}
        profiles[vp] = prof
    host = HostCost(exposure=1.0, group_ms=1.0, budget_ms=8.0, microbatches={0: 4, 1: 4})
    plan = choose(profiles, link_GBps=1000.0, host=host)
    chosen = {k for k, v in plan.points.items() if v}
    # 4 ms per unit: two fit; chunk 0's layers save more (5 microbatches in flight), the later layer first
    assert chosen == {(0, 3), (0, 2)}
    assert plan.expected_saving_bytes == 2 * 5 * 40 * MiB
    nothing = {vp: profile(4, 5.0, {CA: 40 * MiB}) for vp in (0, 1)}
    for prof in nothing.values():
        prof.peak_bytes = {}  # the peak rose before any group was off the device
    empty = choose(nothing, link_GBps=1000.0, host=host)
    assert not any(empty.points.values()) and "would not lower it" in empty.describe()
    # without a trace (CPU) the last layer ranks first, as before
    for prof in profiles.values():
        prof.peak_bytes = None
    assert (0, 4) in {k for k, v in choose(profiles, link_GBps=1000.0, host=host).points.items() if v}


def test_the_traced_peak_keeps_per_key_off_device_bytes_as_they_were_when_the_peak_rose():
    summary = type(get_summary())()
    peaks = iter([100, 100, 150, 150, 120, 200, 200])
    summary.track_peak(lambda: next(peaks), by_key=True)  # reads 100
    summary.off_device(+10, ("a", 1, "core_attn"))  # peak 100: no rise
    summary.off_device(+20, ("a", 2, "core_attn"))  # 150: rose while only layer 1 was off
    summary.off_device(-10, ("a", 1, "core_attn"))  # 150
    summary.off_device(+5, ("a", 3, "qkv_linear"))  # 120 (the statistic never falls; a stand-in)
    summary.off_device(+7, None)  # 200: rose with layers 2 and 3 off; a key-less entry counts in the total only
    assert summary.off_by_key_at_peak == {("a", 2, "core_attn"): 20, ("a", 3, "qkv_linear"): 5}
    assert summary.off_device_at_peak_bytes == 25
    summary.stop_tracking_peak()  # reads 200: no rise
    assert summary.off_by_key is None and summary.off_by_key_at_peak == {("a", 2, "core_attn"): 20,
                                                                         ("a", 3, "qkv_linear"): 5}


def test_a_step_whose_gpu_queue_hides_host_time_offloads_everything_the_link_allows():
    prof = profile(8, 5.0, {CA: 40 * MiB, QKV: 30 * MiB})
    hidden_host = choose({None: prof}, link_GBps=1000.0, host=launch_bound(0.0, 1.0, 10.0))
    assert hidden_host.points == choose({None: prof}, link_GBps=1000.0).points
    assert len([v for v in hidden_host.points.values() if v]) == 8 and hidden_host.host_ms == 0.0


def test_no_affordable_unit_means_an_empty_plan_that_says_why():
    plan = choose({None: profile(4, 5.0, {CA: 40 * MiB})}, link_GBps=1000.0, host=launch_bound(1.0, 1.0, 2.0))
    assert not plan.points and "launch-bound" in plan.describe()


def test_a_target_outranks_the_host_budget():
    prof = profile(4, 5.0, {CA: 40 * MiB})
    plan = choose({None: prof}, link_GBps=1000.0, need_bytes=100 * MiB, host=launch_bound(1.0, 1.0, 2.0))
    assert plan.expected_saving_bytes >= 100 * MiB and not plan.hidden


def test_host_cost_shares_the_probe_host_time_over_groups_and_leaves_out_its_own_exposed_part():
    """The clock's reading plus what it cannot see (OUTSIDE_CLOCK of it) is shared over the probe's groups."""
    k = 1.0 + OUTSIDE_CLOCK
    units = {None: {(1, CA), (1, QKV), (2, CA)}}  # layer 1: one chained group of two units; layer 2: one group
    hc = host_cost(runtime_ms=2 * (1 + JOINED_UNIT_COST + 1) * 3.0, wall_ms=500.0, exposure=0.5,
                   microbatches={None: 2}, unit_layers=units)
    assert hc.group_ms == pytest.approx(3.0 * k)
    assert hc.budget_ms == pytest.approx(HOST_BUDGET * (500.0 - 0.5 * 2 * 2.4 * 3.0 * k))
    assert hc.unit_ms(None, QKV, joined=True) == pytest.approx(0.5 * 3.0 * k * JOINED_UNIT_COST * 2)
    unchained = host_cost(6.0, 500.0, 1.0, {None: 1}, units, chaining=False)
    assert unchained.group_ms == pytest.approx(2.0 * k) and unchained.unit_ms(None, QKV, joined=True) == 2.0 * k
    assert host_cost(6.0, 500.0, None, {None: 1}, units) is None  # no device clock: not measured


def test_the_host_cost_counts_more_than_the_runtime_clock(monkeypatch):
    """The points with nothing moved cost about what the clock reads (sessions 65-67), so a plan priced by the clock
    alone overspends its budget: from the same probe the plan must take fewer layers than the clock alone allows."""
    units = {None: {(layer, CA) for layer in range(1, 9)}}
    prof = profile(8, 5.0, {CA: 8 * MiB})

    def layers_chosen() -> int:
        # 8 layers x 4 microbatches, 32 ms on the clock (1 ms a group by the clock), a 1 s launch-bound step: a
        # budget of about 14 ms fits three layers at 4 ms each by the clock, one at 8 ms with what it cannot see
        hc = host_cost(runtime_ms=32.0, wall_ms=1000.0, exposure=1.0, microbatches={None: 4}, unit_layers=units)
        return len([v for v in choose({None: prof}, 1000.0, host=hc).points.values() if v])

    with_outside = layers_chosen()
    monkeypatch.setattr(auto_choice, "OUTSIDE_CLOCK", 0.0)
    clock_only = layers_chosen()
    assert OUTSIDE_CLOCK > 0 and 0 < with_outside < clock_only == 3
    explicit = host_cost(32.0, 1000.0, 1.0, {None: 4}, units, outside_clock=2.0)  # the argument wins over the constant
    assert explicit.group_ms == pytest.approx(3.0) and explicit.outside_clock == 2.0


def test_the_variable_sets_the_host_time_outside_the_clock_and_a_bad_value_is_one_sentence(monkeypatch, caplog):
    """MCORE_OFFLOAD_AUTO_OUTSIDE_CLOCK=0 prices a group at the clock alone (the model before session 67), for
    comparing the two on one host; the plan line says which was used."""
    with caplog.at_level(logging.INFO, logger="mcore_offload.runtime.auto"):
        plan = _probe({(None, 1, "core_attn"): 16 * MiB})[1][-1]
    assert "where the GPU had caught up with the host, of the measured step's microbatches: chunk None: L2 1/1 " \
           "L3 1/1" in caplog.text
    assert plan.host.group_ms == pytest.approx(2.0 * (1.0 + OUTSIDE_CLOCK))
    assert f"with {OUTSIDE_CLOCK:.1f}x the clock outside it" in plan.describe()
    monkeypatch.setenv(OUTSIDE_CLOCK_VARIABLE, "0")
    plan = _probe({(None, 1, "core_attn"): 16 * MiB})[1][-1]
    assert plan.host.group_ms == pytest.approx(2.0) and "with 0.0x the clock outside it" in plan.describe()
    for bad in ("-1", "lots", "inf"):
        monkeypatch.setenv(OUTSIDE_CLOCK_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"{OUTSIDE_CLOCK_VARIABLE}=.* is not a number of at least 0; set it"):
            AutoPlanner(None)


def test_the_bytes_a_unit_moves_cost_step_time_of_their_own_where_the_step_is_launch_bound():
    """The link traffic alone cost 0.8-1.5 % of an H100 step per GiB moved (sessions 16-17), beyond the runtime's host
    time: the plan counts it, so a unit that moves more costs more, and a budget that the groups alone would fit can
    leave a layer out."""
    units = {None: {(1, CA)}}
    hc = host_cost(runtime_ms=4.0, wall_ms=504.0, exposure=0.5, microbatches={None: 4}, unit_layers=units)
    plain_ms = 504.0 - 0.5 * 4.0 * (1.0 + OUTSIDE_CLOCK)
    assert hc.gib_ms == pytest.approx(0.5 * TRAFFIC_SHARE_PER_GIB * plain_ms)
    group_only = hc.unit_ms(None, CA, joined=False)
    assert hc.unit_ms(None, CA, joined=False, nbytes=2**30) == pytest.approx(group_only + 4 * hc.gib_ms)
    assert hc.unit_ms(None, CA, joined=False, nbytes=2**29) < hc.unit_ms(None, CA, joined=False, nbytes=2**30)
    # 4 layers of 128 MiB a microbatch, 4 microbatches: 0.5 GiB a step each; 1 ms per group and microbatch
    prof = profile(4, 5.0, {CA: 128 * MiB})
    free_bytes = HostCost(exposure=1.0, group_ms=1.0, budget_ms=12.0, microbatches={None: 4})
    priced = HostCost(exposure=1.0, group_ms=1.0, budget_ms=12.0, microbatches={None: 4}, gib_ms=4.0)
    assert len([v for v in choose({None: prof}, 1000.0, host=free_bytes).points.values() if v]) == 3  # 4 ms each
    plan = choose({None: prof}, 1000.0, host=priced)  # 4 + 0.5 GiB x 4 ms = 6 ms each: two fit
    assert len([v for v in plan.points.values() if v]) == 2
    assert plan.host_ms == pytest.approx(12.0) and "4.0 ms per GiB moved" in plan.describe()


class _Mark:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_marks_count_the_layer_starts_where_the_gpu_had_caught_up():
    marks = ChunkMarks(None)
    for done in (True, False, True, True):
        marks.layer_started(_Mark(done))
    # the first start has no predecessor; then the previous marks were True, False, True
    assert (marks.checks, marks.caught_up) == (3, 2) and len(marks.layers) == 4
    host = ChunkMarks(None)
    for t in (1.0, 2.0):
        host.layer_started(t)  # host clocks (CPU): nothing to compare with
    assert host.checks == 0


def test_the_probe_log_says_at_which_layers_the_gpu_had_caught_up():
    """Per chunk and layer, over the chunk's forwards (microbatches): where the step exposes host time."""
    marks = []
    for vp, pattern in ((0, (True, False, True)), (0, (True, True, False)), (1, (False, False, False))):
        m = ChunkMarks(vp)
        for done in pattern:
            m.layer_started(_Mark(done))
        m.layer_started(_Mark(True))  # the last start checks the one before it
        marks.append(m)
    assert caught_up_by_layer(marks) == "chunk 0: L2 2/2 L3 1/2 L4 1/2; chunk 1: L2 0/1 L3 0/1 L4 0/1"
    cpu = ChunkMarks(None)
    for t in (1.0, 2.0):
        cpu.layer_started(t)
    assert caught_up_by_layer([cpu]) == ""


def test_a_units_bytes_are_its_storages_summed_per_microbatch():
    planner = AutoPlanner(None)
    planner.steps = PROBE_STEPS - 2  # the measured step
    for mb in range(3):
        planner.offloaded(None, mb, 1, "core_attn", 10 * MiB)
        planner.offloaded(None, mb, 1, "attn_proj", 4 * MiB)
        planner.offloaded(None, mb, 1, "core_attn", (1 + mb) * MiB)
    assert planner._profiles(lambda a, b: 1.0)[None].unit_bytes == {(1, CA): 16 * MiB}


def _probe(off_at_peak: dict | None) -> tuple[list, list]:
    """Run a planner through its probe steps: layers 1 and 2 offload 8 MiB per microbatch in the measured step."""
    planner = AutoPlanner(None)
    phases, plans = [], []
    clocks = lambda a, b: 1.0  # noqa: E731 (every layer 1 ms)
    for _ in range(PROBE_STEPS):
        phases.append((planner.measuring, planner.tracing_peak))
        if planner.measuring:
            planner.chunk_started(None)
            planner._probe_t0 -= 1.0  # a 1 s step: 15 ms of host budget
            for _ in range(3):
                planner._marks[-1].layer_started(_Mark(True))  # launch-bound: exposure 1
            for mb in range(2):
                for layer in (1, 2):
                    planner.offloaded(None, mb, layer, "core_attn", 8 * MiB)
            plans.append(planner.step_ended(clocks, 50.0, None, 0, runtime_ms=4.0))
        elif planner.tracing_peak:
            planner.offloaded(None, 0, 3, "core_attn", 64 * MiB)  # not the measured step: not counted
            plans.append(planner.step_ended(clocks, None, 900 * MiB, 16 * MiB, runtime_ms=400.0,
                                            off_at_peak=off_at_peak))
        else:
            plans.append(planner.step_ended(clocks, None, None, 0))
    assert plans[-1] is planner.plan and not planner.measuring and not planner.tracing_peak
    return phases, plans


def test_the_probe_measures_one_step_and_traces_the_peak_in_the_next():
    """The peak step's allocator reads must not inflate the measured step's host time: two steps, one plan."""
    phases, plans = _probe({(None, 1, "core_attn"): 16 * MiB, (None, 2, "core_attn"): 0})
    assert phases[-2:] == [(True, False), (False, True)] and not any(phases[0])
    assert plans[:-1] == [None] * (PROBE_STEPS - 1)
    plan = plans[-1]
    # layer 2 was back on the device at the peak: only layer 1 saves, with the measured step's link and bytes
    assert {k: set(v) for k, v in plan.points.items() if v} == {(None, 1): {"core_attn", "attn_proj"}}
    assert plan.link_GBps == 50.0 and plan.expected_saving_bytes == 16 * MiB
    # the host time is the measured step's (4 ms on the clock over one chunk forward's two groups, with what the
    # clock cannot see), not the peak step's (400 ms: nothing would fit the 15 ms budget)
    assert plan.host.exposure == 1.0 and plan.host.group_ms == pytest.approx(2.0 * (1.0 + OUTSIDE_CLOCK))


def test_a_probe_that_peaked_with_nothing_off_the_device_ranks_units_by_bytes():
    """With every point offloaded the peak can move where no activation is held (B: the first backward's gradient
    allocations); a smaller plan moves it back, so the plan falls back to bytes instead of choosing nothing."""
    plan = _probe({(None, 1, "core_attn"): 0})[1][-1]
    assert {k for k, v in plan.points.items() if v} == {(None, 1), (None, 2)}
    assert plan.expected_saving_bytes == 16 * MiB and "ranked by bytes" in plan.describe()


@pytest.fixture(scope="module")
def _parallel():
    init_parallel()
    yield


def train_auto_bitwise_equal(caplog: pytest.LogCaptureFixture, build=build_dense_gpt, min_size: int = 512) -> None:
    """Train the tests' 3-layer GPT (``build``) with offload_modules=["auto"] two steps past its probe, logging at
    INFO, and check its losses and gradients against a run without offloading, bit for bit."""
    kw = dict(n_steps=PROBE_STEPS + 2, num_microbatches=2, seq_len=16, micro_batch_size=2, lr=0.1)
    ref = run_steps(build(num_layers=3), **kw)
    overrides = dict(fine_grained_activation_offloading=True, offload_modules=["auto"],
                     min_offloaded_tensor_size=min_size)
    with caplog.at_level(logging.INFO, logger="mcore_offload"):
        got = run_steps(build(num_layers=3, config_overrides=overrides), **kw)
    assert got.losses == ref.losses
    for ga, gb in zip(got.grads, ref.grads, strict=True):
        assert all((ga[k] == gb[k]).all() for k in ga)


def test_auto_on_a_real_model_probes_then_offloads_its_plan_bitwise_equal(_parallel, caplog):
    train_auto_bitwise_equal(caplog)
    plan = get_manager().auto.plan
    assert plan is not None and plan.hidden  # on CPU the "link" is a memcpy: everything fits
    assert sum(1 for m in caplog.messages if m.startswith("offload auto plan")) == 1
    # auto's probe steps move the whole set on purpose: no warning that the copies are exposed
    assert get_summary().exposed_copies_warned and not any("waited" in m for m in caplog.messages)
    steps = get_summary().steps
    # the probe offloads every point; the planned steps offload the chosen ones, all released and restored
    assert {"qkv_linear", "core_attn"} <= {p for p, c in steps[0].points.items() if c["offloaded"]}
    for step in steps[PROBE_STEPS:]:
        assert step.total("offloaded") > 0
        assert step.total("released_in_forward") == step.total("offloaded") == step.total("reloaded")
    assert plan.points[(None, 3)]  # the last layer, kept on the device, still triggers the first prefetch
    chosen = {p for pts in plan.points.values() for p in pts}
    assert {p for p, c in steps[-1].points.items() if c["offloaded"]} <= chosen


def test_auto_on_a_sequential_mlp_moe_model_plans_the_expert_points_bitwise_equal(_parallel, caplog):
    """The tests' MoE GPT (a SequentialMLP: every local expert runs its own expert_fc1 and moe_act points) under
    ``auto``: the probe offloads the expert points of every expert, the plan is logged once, and the planned steps
    stay bitwise equal and move what they offload back."""
    train_auto_bitwise_equal(caplog, build_moe_gpt, min_size=64)
    plan = get_manager().auto.plan
    assert plan is not None and sum(1 for m in caplog.messages if m.startswith("offload auto plan")) == 1
    steps = get_summary().steps
    assert {"expert_fc1", "moe_act"} <= {p for p, c in steps[0].points.items() if c["offloaded"]}
    chosen = {p for pts in plan.points.values() for p in pts}
    assert {"expert_fc1", "moe_act"} <= chosen  # on CPU the "link" is a memcpy: everything fits
    for step in steps[PROBE_STEPS:]:
        assert step.total("offloaded") > 0
        assert step.total("released_in_forward") == step.total("offloaded") == step.total("reloaded")


def test_an_aborted_measured_step_is_measured_again_from_scratch():
    """A fault in the measured step: its bytes and its host clock are dropped, not added to the next step's."""
    planner = AutoPlanner(None)
    planner.steps = PROBE_STEPS - 2
    planner.chunk_started(None)
    planner._probe_t0 -= 100.0  # the failed step started long ago
    planner.offloaded(None, 0, 1, "core_attn", 8 * MiB)
    planner.step_aborted()
    assert planner.measuring and planner._probe_t0 is None and not planner._marks
    planner.chunk_started(None)
    planner._probe_t0 -= 0.5  # this step: half a second
    for _ in range(3):
        planner._marks[-1].layer_started(_Mark(True))
    planner.offloaded(None, 0, 1, "core_attn", 8 * MiB)
    assert planner._profiles(lambda a, b: 1.0)[None].unit_bytes == {(1, CA): 8 * MiB}
    planner.step_ended(lambda a, b: 1.0, 50.0, None, 0, runtime_ms=0.0)
    # the budget is a share of this step's wall time, not of one that began with the failed step
    assert planner._measured[1].budget_ms == pytest.approx(HOST_BUDGET * 500, rel=0.05)


def test_auto_on_a_real_model_survives_a_fault_in_its_measured_step(_parallel):
    """Through the manager: the measured step fails in its second microbatch, the next step measures the same bytes
    a clean run measures, and the numbers stay bitwise equal."""
    kw = dict(num_microbatches=2, seq_len=16, micro_batch_size=2)
    overrides = dict(fine_grained_activation_offloading=True, offload_modules=["auto"], min_offloaded_tensor_size=512)
    clean = build_dense_gpt(num_layers=3, config_overrides=overrides)
    run_steps(clean, n_steps=PROBE_STEPS - 1, **kw)
    expected = {vp: p.unit_bytes for vp, p in get_manager().auto._measured[0].items()}
    assert any(expected.values())
    reset()

    chunks = build_dense_gpt(num_layers=3, config_overrides=overrides)
    ref = build_dense_gpt(num_layers=3)
    run_steps(chunks, n_steps=PROBE_STEPS - 2, **kw)
    assert get_manager().auto.measuring
    layer = chunks[0].decoder.layers[1].self_attention
    original, calls = layer.forward, {"n": 0}

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second microbatch: the first one's groups were offloaded and counted
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    layer.forward = failing_forward
    with pytest.raises(RuntimeError, match="injected fault"):
        run_steps(chunks, n_steps=1, **kw)
    layer.forward = original
    auto = get_manager().auto
    assert auto.measuring and auto._probe_t0 is None and not auto._bytes
    run_steps(chunks, n_steps=1, **kw)
    assert {vp: p.unit_bytes for vp, p in auto._measured[0].items()} == expected
    got, want = run_steps(chunks, n_steps=2, **kw), run_steps(ref, n_steps=2, **kw)  # the peak step, then the plan
    assert auto.plan is not None and got.losses == want.losses
    for ga, gb in zip(got.grads, want.grads, strict=True):
        assert all((ga[k] == gb[k]).all() for k in ga)


def auto_against_plain(base: dict) -> None:
    """Train three layers with ``base``'s config, without offloading and with ``auto``, through the probe and two
    planned steps; the loss and every gradient bitwise equal."""
    kw = dict(n_steps=PROBE_STEPS + 2, num_microbatches=2, seq_len=16, micro_batch_size=2, lr=0.1)
    ref = run_steps(build_dense_gpt(num_layers=3, config_overrides=base), **kw)
    overrides = dict(base, fine_grained_activation_offloading=True, offload_modules=["auto"],
                     min_offloaded_tensor_size=512)
    got = run_steps(build_dense_gpt(num_layers=3, config_overrides=overrides), **kw)
    assert got.losses == ref.losses
    for ga, gb in zip(got.grads, ref.grads, strict=True):
        assert all((ga[k] == gb[k]).all() for k in ga)


def test_auto_under_block_recompute_plans_only_the_layers_that_save_activations(_parallel):
    """Full recompute of the first layer of three (block method): the probe sees no group of layer 1 (its
    forward runs without grad, its recompute inside backward), so the plan holds layers 2 and 3 only, and the
    planned steps keep the loss and gradients of the same recompute without offloading."""
    auto_against_plain(dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1))
    plan = get_manager().auto.plan
    assert plan is not None and set(plan.points) == {(None, 2), (None, 3)}
    assert get_summary().steps[-1].total("offloaded") > 0
