"""``mcore_offload.paused()`` and the one-lookup exit of points a config never enables (toy model, CPU)."""

from __future__ import annotations

import pytest
import torch

import mcore_offload
from mcore_offload.runtime import points
from mcore_offload.runtime.enabled import enabled_points
from mcore_offload.runtime.manager import get_manager
from mcore_offload.summary import get_summary
from tests.test_runtime_unit import Toy, cfg, train_step


def inputs(step):
    return [torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + i)) for i in range(2)]


def grads_and_losses(model, step):
    model.zero_grad()
    losses = train_step(model, inputs(step))
    return losses, [p.grad.clone() for p in model.parameters()]


def test_paused_steps_offload_nothing_and_alternate_with_offloaded_steps():
    base = Toy(cfg())
    model = Toy(cfg("qkv_linear", "core_attn"))
    for step in range(4):
        want = grads_and_losses(base, step)
        before = len(get_summary().steps)
        if step % 2:
            with mcore_offload.paused():
                got = grads_and_losses(model, step)
            assert len(get_summary().steps) == before  # nothing offloaded, nothing recorded
        else:
            got = grads_and_losses(model, step)
            last = get_summary().steps[-1]
            assert last.total("offloaded") > 0 and last.total("reloaded") == last.total("offloaded")
        assert all(torch.equal(a, b) for a, b in zip(want[0], got[0]))
        assert all(torch.equal(a, b) for a, b in zip(want[1], got[1]))
    assert get_manager().pause_depth == 0 and not get_manager().handlers


def test_paused_nests_and_unwinds_on_an_exception():
    with pytest.raises(RuntimeError, match="inner"):
        with mcore_offload.paused():
            with mcore_offload.paused():
                assert get_manager().pause_depth == 2
                raise RuntimeError("inner")
    assert get_manager().pause_depth == 0


def test_enabled_points_of_a_config():
    assert enabled_points(cfg("core_attn")) == {"core_attn"}
    assert enabled_points(cfg()) == frozenset()
    auto = cfg("auto")
    auto.recompute_granularity, auto.recompute_modules = "selective", ["core_attn"]
    assert "core_attn" not in enabled_points(auto) and "qkv_linear" in enabled_points(auto)


def test_a_point_called_with_another_config_object_is_still_checked_in_full():
    # the one-lookup exit trusts only the chunk's own config: a layer built with another config object that
    # enables the point still offloads through it
    model = Toy(cfg("core_attn"))
    layer_config = cfg("core_attn", "qkv_linear")
    real_layer = model.layer

    def layer(x, qkv, proj):
        points.layer_boundary(model.config)
        with points.offload("qkv_linear", layer_config, x) as h:
            mixed = qkv(torch.tanh(h))
        mixed = points.commit("qkv_linear", layer_config, mixed)
        return x + proj(mixed[..., :16])

    model.layer = layer
    train_step(model, inputs(0))
    assert get_summary().last_step.points["qkv_linear"]["offloaded"] > 0
    model.layer = real_layer
    train_step(model, inputs(1))  # the chunk's own config: qkv_linear takes the exit, core_attn offloads
    assert "qkv_linear" not in get_summary().last_step.points
    assert get_summary().last_step.points["core_attn"]["offloaded"] > 0
