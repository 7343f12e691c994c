"""``auto``'s units: core_attn and attn_proj are planned together only where they share one storage.

In 16-bit training attn_proj saves a view of core attention's output, so auto plans the two as one unit. Under FP8
(TE's projection saves its own FP8 copy) and under core_attn recompute (the checkpoint keeps no output) attn_proj
frees memory alone, the rule config validation applies to an explicit list (``attn_proj_alone_frees_nothing``), and
auto plans it on its own: it may then take attn_proj's small, hidden copies without core_attn's large ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mcore_offload.runtime import auto as auto_module
from mcore_offload.runtime.auto import PROBE_STEPS, SPLIT_UNITS, UNITS, AutoPlanner, attention_units, unit_of
from mcore_offload.runtime.auto_choice import (
    CHAIN_PREVIOUS,
    JOINED_UNIT_COST,
    HostCost,
    choose,
    joins_a_group,
    layer_groups,
    probe_groups,
)
from mcore_offload.runtime.handler import ChunkOffloadHandler
from mcore_offload.runtime.manager import get_manager
from mcore_offload.runtime.saved import CHAIN_NEXT
from tests.harness.gpt import init_parallel
from tests.test_auto import auto_against_plain, profile
from tests.test_offload_recompute import checkpoint_without_te  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
MiB = 2**20
CA, CORE, PROJ, QKV = ("core_attn", "attn_proj"), ("core_attn",), ("attn_proj",), ("qkv_linear",)


def _config(**fields: object) -> SimpleNamespace:
    base = dict(fp8=None, recompute_granularity=None, recompute_modules=None, moe_layer_recompute=False)
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize(("fields", "split"), [
    (dict(), False),
    (dict(fp8="hybrid"), True),
    (dict(fp8="e4m3"), True),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn"]), True),
    (dict(recompute_granularity="selective", recompute_modules=None), True),  # megatron's default: core_attn
    (dict(recompute_granularity="selective", recompute_modules=["mlp"]), False),
    (dict(recompute_granularity="full"), False),
], ids=["bf16", "fp8-hybrid", "fp8-e4m3", "core_attn-recompute", "default-selective", "mlp-recompute", "full"])
def test_attn_proj_is_a_unit_of_its_own_exactly_where_it_frees_memory_alone(fields, split):
    assert attention_units(_config(**fields)) == (SPLIT_UNITS if split else UNITS)


def test_split_units_hold_every_point_once():
    assert sorted(p for u in SPLIT_UNITS for p in u) == sorted(p for u in UNITS for p in u)
    assert all(len(u) == 1 for u in SPLIT_UNITS)


def test_the_measured_step_counts_split_units_apart():
    planner = AutoPlanner(None, SPLIT_UNITS)
    planner.steps = PROBE_STEPS - 2  # the measured step
    for mb in range(2):
        planner.offloaded(None, mb, 1, "core_attn", 64 * MiB)
        planner.offloaded(None, mb, 1, "attn_proj", 8 * MiB)
    assert planner._profiles(lambda a, b: 1.0)[None].unit_bytes == {(1, CORE): 64 * MiB, (1, PROJ): 8 * MiB}
    merged = AutoPlanner(None)
    merged.steps = PROBE_STEPS - 2
    merged.offloaded(None, 0, 1, "core_attn", 64 * MiB)
    merged.offloaded(None, 0, 1, "attn_proj", 8 * MiB)
    assert merged._profiles(lambda a, b: 1.0)[None].unit_bytes == {(1, CA): 72 * MiB}


def test_split_units_let_the_plan_take_attn_proj_without_core_attn():
    """Per layer and microbatch attn_proj 8 MiB and qkv_linear 24 MiB (FP8 A's, by the planner) and a core attention
    of 128 MiB, against 0.78 ms of forward a layer at 50 GB/s: core_attn's copies never hide, even with the layer
    of lag the queue allows. Merged with core_attn, attn_proj is never chosen; split, every layer offloads
    qkv_linear and attn_proj."""
    split = choose({None: profile(8, 0.78, {CORE: 128 * MiB, PROJ: 8 * MiB, QKV: 24 * MiB})}, link_GBps=50.0)
    merged = choose({None: profile(8, 0.78, {CA: 136 * MiB, QKV: 24 * MiB})}, link_GBps=50.0)
    assert split.hidden and merged.hidden
    assert all(split.points[(None, i)] == {"qkv_linear", "attn_proj"} for i in range(1, 9))
    assert not any("attn_proj" in v for v in merged.points.values())
    assert split.expected_saving_bytes == 8 * 32 * MiB > merged.expected_saving_bytes


def test_only_neighbouring_points_join_a_group():
    assert CHAIN_PREVIOUS == {v: k for k, v in CHAIN_NEXT.items()}
    assert joins_a_group(CORE, {"qkv_linear"}) and joins_a_group(PROJ, {"core_attn"})
    assert joins_a_group(QKV, {"core_attn"}) and joins_a_group(CA, {"qkv_linear"})
    assert joins_a_group(("moe_act",), {"expert_fc1"}) and joins_a_group(("expert_fc1",), {"moe_act"})
    # with core_attn off, qkv_linear and attn_proj open a group each (runtime/points.py chains neighbours only)
    assert not joins_a_group(PROJ, {"qkv_linear"}) and not joins_a_group(QKV, {"attn_proj"})
    assert not joins_a_group(("mlp_norm",), {"qkv_linear", "core_attn"}) and not joins_a_group(CORE, set())


def test_the_host_cost_of_qkv_linear_with_attn_proj_is_two_groups():
    host = HostCost(exposure=1.0, group_ms=1.0, budget_ms=100.0, microbatches={None: 1})
    prof = profile(1, 10.0, {PROJ: 8 * MiB, QKV: 24 * MiB})
    assert choose({None: prof}, 1000.0, host=host).host_ms == pytest.approx(2.0)
    prof = profile(1, 10.0, {CORE: 8 * MiB, QKV: 24 * MiB})
    assert choose({None: prof}, 1000.0, host=host).host_ms == pytest.approx(1.0 + JOINED_UNIT_COST)


def test_the_probe_counts_a_group_per_chain_of_neighbours():
    J = JOINED_UNIT_COST
    assert layer_groups({QKV, CA}) == pytest.approx(1 + J)  # 16-bit attention: one chain
    assert layer_groups({QKV, CORE, PROJ}) == pytest.approx(1 + 2 * J)  # split units, all on: one chain
    assert layer_groups({QKV, PROJ}) == pytest.approx(2.0)  # core_attn left out (its recompute): a gap
    assert layer_groups({("attn_norm",), QKV, CA, ("mlp_norm",), ("expert_fc1",), ("moe_act",)}) == \
        pytest.approx(4 + 2 * J)
    assert layer_groups({QKV, CORE, PROJ}, chaining=False) == 3.0
    assert probe_groups({None: 2, 1: 3}, {None: {(1, QKV), (1, PROJ), (2, QKV)}, 1: {(1, CA)}}) == \
        pytest.approx(2 * 3 + 3 * 1)


@pytest.mark.usefixtures("checkpoint_without_te")
@pytest.mark.parametrize("base", [dict(), dict(recompute_granularity="selective", recompute_modules=["core_attn"])],
                         ids=["bf16", "core_attn-recompute"])
def test_the_probes_group_count_is_the_groups_the_runtime_opened(base, monkeypatch):
    """The probe's host time is shared out over the groups that moved bytes in the measured step: the count from the
    units with bytes (``probe_groups``) equals the groups the handlers opened there, each further unit with bytes of
    a group counting JOINED_UNIT_COST. Under core_attn recompute the probe leaves core_attn out, and qkv_linear and
    attn_proj open a group each (counting them as one chain, as a family table did before session 66, overstated
    each group's host time by 2 / 1.4)."""
    init_parallel()
    opened, probed = [], []
    real_open, real_cost = ChunkOffloadHandler.open_group, auto_module.host_cost

    def open_group(self, name):
        group = real_open(self, name)
        if self.manager.auto is not None and self.manager.auto.measuring:
            opened.append(group)
        return group

    def host_cost(runtime_ms, wall_ms, exposure, microbatches, unit_layers, *args):
        probed.append((probe_groups(microbatches, unit_layers, *args[:1]), unit_layers[None]))
        return real_cost(runtime_ms, wall_ms, exposure, microbatches, unit_layers, *args)

    monkeypatch.setattr(ChunkOffloadHandler, "open_group", open_group)
    monkeypatch.setattr(auto_module, "host_cost", host_cost)
    auto_against_plain(base)
    units = get_manager().auto.units
    assert len(probed) == 1 and opened
    counted, with_bytes = probed[0]
    runtime = 0.0
    for g in opened:  # layer 1's attn_norm saves only tensors under the size floor here: no bytes, not counted
        moved = {unit_of(p, units) for p in g.points} & {u for layer, u in with_bytes if layer == g.layer}
        runtime += 1 + JOINED_UNIT_COST * (len(moved) - 1) if moved else 0.0
    assert counted == pytest.approx(runtime)
    if base:  # the gap: no group spans qkv_linear and attn_proj
        assert (1, PROJ) in with_bytes and (1, QKV) in with_bytes
        assert not any({"qkv_linear", "attn_proj"} <= set(g.points) for g in opened)


@pytest.mark.usefixtures("checkpoint_without_te")
def test_auto_under_core_attn_recompute_plans_attn_proj_alone_bitwise_equal():
    """Under selective recompute of core_attn, auto's probe leaves core_attn out (it would offload nothing) and
    plans attn_proj as a unit of its own; the planned steps keep the loss and every gradient of the same recompute
    without offloading."""
    init_parallel()
    auto_against_plain(dict(recompute_granularity="selective", recompute_modules=["core_attn"]))
    auto = get_manager().auto
    assert auto.units == SPLIT_UNITS and auto.plan is not None
    chosen = {p for pts in auto.plan.points.values() for p in pts}
    assert "attn_proj" in chosen and "core_attn" not in chosen
