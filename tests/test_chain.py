"""Chains: consecutive points of one layer share one group (one start node, one commit node); CPU, toy model."""

from __future__ import annotations

import pytest
import torch

from mcore_offload.runtime import points
from mcore_offload.runtime.handler import ChunkOffloadHandler
from mcore_offload.runtime.manager import get_manager, reset
from mcore_offload.summary import get_summary
from tests.test_runtime_unit import Toy, cfg, run, train_step

ATTN = ["qkv_linear", "core_attn", "attn_proj"]


def counted_run(monkeypatch, names, chaining, steps=2):
    """``run`` with chaining on or off; returns the results, groups opened per step and per-point bytes."""
    monkeypatch.setenv("MCORE_OFFLOAD_CHAIN_POINTS", "1" if chaining else "0")
    reset()
    opened = []
    open_group = ChunkOffloadHandler.open_group

    def counting(self, name):
        opened.append(name)
        return open_group(self, name)

    monkeypatch.setattr(ChunkOffloadHandler, "open_group", counting)
    results = run(names, steps=steps)
    return results, len(opened) // steps, {p: dict(c) for p, c in get_summary().last_step.points.items()}


@pytest.mark.parametrize("names", [ATTN, ["qkv_linear", "core_attn"], ["core_attn", "attn_proj"]])
def test_a_chain_is_one_group_per_layer_and_changes_neither_numbers_nor_bytes(monkeypatch, names):
    base = run([])
    chained, groups_chained, bytes_chained = counted_run(monkeypatch, names, chaining=True)
    single, groups_single, bytes_single = counted_run(monkeypatch, names, chaining=False)
    for got in (chained, single):
        for (l0, g0), (l1, g1) in zip(base, got):
            assert all(torch.equal(a, b) for a, b in zip(l0, l1))
            assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    # the toy: 3 layers x 2 microbatches per step
    assert groups_single == 6 * len(names) and groups_chained == 6
    # every point keeps its own byte counts (attn_proj's input is core attention's output: counted once, under
    # core_attn, either way)
    assert bytes_chained == bytes_single
    assert bytes_chained["core_attn"]["offloaded"] > 0 and bytes_chained["core_attn"]["reloaded"] > 0
    assert get_summary().host_resident_bytes == 0 and not get_manager().handlers


def test_points_out_of_chain_order_keep_separate_groups(monkeypatch):
    # qkv_linear and attn_proj are both on but core_attn, between them, is off: no chain forms
    _, groups, _ = counted_run(monkeypatch, ["qkv_linear"], chaining=True)
    assert groups == 6


def test_a_chain_whose_next_point_never_comes_still_reloads_everything():
    """The layer skips core_attn after qkv_linear's commit: the open group is queued at the layer boundary and
    reloaded without its commit node (prefetch or unpack); numbers stay equal, nothing is left behind."""
    def layer_without_core_attn(model):
        def layer(x, qkv, proj):
            points.layer_boundary(model.config)
            with points.offload("qkv_linear", model.config, x) as h:
                mixed = qkv(torch.tanh(h))
            mixed = points.commit("qkv_linear", model.config, mixed)
            return x + proj(torch.relu(mixed[..., :16]))
        return layer

    results = []
    for names in ([], ["qkv_linear", "core_attn"]):
        model = Toy(cfg(*names))
        model.layer = layer_without_core_attn(model)
        inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        results.append((train_step(model, inputs), [p.grad.clone() for p in model.parameters()]))
        assert get_manager().chain is None
    (l0, g0), (l1, g1) = results
    assert all(torch.equal(a, b) for a, b in zip(l0, l1)) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    last = get_summary().last_step
    assert last.total("offloaded") > 0 and last.total("reloaded") == last.total("offloaded")
    assert get_summary().host_resident_bytes == 0 and not get_manager().handlers
