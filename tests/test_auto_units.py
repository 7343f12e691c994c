"""``auto``'s units: core_attn and attn_proj are planned together only where they share one storage.

In 16-bit training attn_proj saves a view of core attention's output, so auto plans the two as one unit. Under FP8
(TE's projection saves its own FP8 copy) and under core_attn recompute (the checkpoint keeps no output) attn_proj
frees memory alone, the rule config validation applies to an explicit list (``attn_proj_alone_frees_nothing``), and
auto plans it on its own: it may then take attn_proj's small, hidden copies without core_attn's large ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mcore_offload.runtime import points
from mcore_offload.runtime.auto import PROBE_STEPS, SPLIT_UNITS, UNITS, AutoPlanner, attention_units
from mcore_offload.runtime.auto_choice import (
    CHAIN_PREVIOUS,
    JOINED_UNIT_COST,
    HostCost,
    choose,
    joins_a_group,
)
from mcore_offload.runtime.manager import get_manager
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
    assert CHAIN_PREVIOUS == {v: k for k, v in points.CHAIN_NEXT.items()}
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
