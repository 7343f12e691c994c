"""A plan that leaves a layer out (``auto`` chose L5, L6 and L8 of B in session 69) must still prefetch the layer
below the gap: backward needs it next. Session 69 measured the gap's cost on the H200: half of the plan's reloads on
demand, 9.8 ms of stall a step and +1.83 % against +0.08 % for a plan without a gap."""

from __future__ import annotations

import pytest
import torch
from test_runtime_unit import Toy, cfg, toy_steps

from mcore_offload.runtime import manager as manager_module
from mcore_offload.runtime import points
from mcore_offload.runtime.auto_choice import Plan
from mcore_offload.runtime.manager import get_manager
from mcore_offload.summary import get_summary

POINTS = frozenset({"qkv_linear", "core_attn", "attn_proj"})


def assert_bitwise_equal(base: list, got: list) -> None:
    """Every step's losses and gradients of two :func:`toy_steps` runs, bit for bit."""
    for (l0, g0), (l1, g1) in zip(base, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))


@pytest.mark.parametrize("native", ["0", "1"])
@pytest.mark.parametrize("prefetch", ["layer", "tail"])
def test_a_layer_left_out_of_the_plan_does_not_stop_the_prefetch(monkeypatch, native, prefetch):
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", native)
    monkeypatch.setenv("MCORE_OFFLOAD_PREFETCH", prefetch)
    manager_module.reset()
    base = toy_steps(Toy(cfg(), layers=6), steps=3)
    manager_module.reset()
    model = Toy(cfg("auto"), layers=6)
    toy_steps(model, steps=1)  # the manager and its planner exist once a chunk began
    # layers 2, 3, 5 and 6 offload (the last stays on the device at PP=1), layer 4 does not
    get_manager().auto.plan = Plan({(None, layer): POINTS for layer in (2, 3, 5, 6)}, 0, True, 1000.0)
    get_summary().steps.clear()
    got = toy_steps(model, steps=3)
    assert_bitwise_equal(base, got)
    last = get_summary().last_step
    assert last.total("reloaded") == last.total("offloaded") > 0
    # layer 5's backward brings layer 3 back ahead of time, across layer 4
    assert last.total("reloaded_on_demand") == 0
    manager_module.reset()


class NormToy(Toy):
    """The toy with a point committed at the layer's output, as megatron-core's ``mlp_norm`` is (after the
    bias-dropout-add): its commit hook and the next layer's start hook are on one autograd node."""

    def layer(self, x, qkv, proj):
        points.layer_boundary(self.config)
        with points.offload("qkv_linear", self.config, x) as h:
            mixed = qkv(torch.tanh(h))
        mixed = points.commit("qkv_linear", self.config, mixed)
        with points.offload("mlp_norm", self.config, mixed) as m:
            normed = torch.tanh(m) * m
        return points.commit("mlp_norm", self.config, x + proj(normed[..., : x.shape[-1]]))


@pytest.mark.parametrize("native", ["0", "1"])
def test_a_late_prefetch_brings_back_the_layer_output_point_below_before_it_is_needed(monkeypatch, native):
    """D-moe's probe steps (sessions 69-70) reloaded ``mlp_norm`` of each chunk's first layer on demand: under a late
    prefetch the layer above, done at the same node as that commit, must start its burst first."""
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", native)
    monkeypatch.setenv("MCORE_OFFLOAD_PREFETCH", "late")
    names = ("qkv_linear", "mlp_norm")
    manager_module.reset()
    base = toy_steps(NormToy(cfg(), layers=4), steps=2)
    manager_module.reset()
    got = toy_steps(NormToy(cfg(*names), layers=4), steps=2)
    assert_bitwise_equal(base, got)
    last = get_summary().last_step
    assert last.points["mlp_norm"]["reloaded"] == last.points["mlp_norm"]["offloaded"] > 0
    assert get_summary().as_dict()["reloaded_on_demand_per_step"] == [0, 0]
    manager_module.reset()


def test_reloads_no_prefetch_started_are_counted_by_step_and_point(monkeypatch):
    """What the benchmark JSON carries to find a missed prefetch (D-moe's last stage, sessions 69-70): the bytes
    reloaded on demand per step, and where ("step N: point", or the (chunk, layer, point) of auto's peak step)."""
    from mcore_offload.runtime.prefetch import Prefetch

    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "0")
    monkeypatch.setattr(Prefetch, "_prefetch", lambda self, group: None)  # every reload then comes on demand
    manager_module.reset()
    toy_steps(Toy(cfg(*sorted(POINTS)), layers=3), steps=2)
    out = get_summary().as_dict()
    assert out["reloaded_on_demand_per_step"] == [s.total("reloaded") for s in get_summary().steps]
    assert out["reloaded_on_demand_per_step"][1] > 0
    by_key = out["on_demand_by_key"]
    assert {k.split(": ")[0] for k in by_key} == {"step 0", "step 1"}
    assert sum(v for k, v in by_key.items() if k.startswith("step 1")) == out["reloaded_on_demand_per_step"][1]
    assert {k.split(": ")[1] for k in by_key} <= POINTS
    manager_module.reset()
