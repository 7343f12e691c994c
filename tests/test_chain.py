"""Chains: consecutive points of one layer share one group (one start node, one commit node); CPU, toy model."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

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


def _layer_committing_with(model, commit_config, commit_context):
    """The Toy's layer, with each point's commit given ``commit_config`` inside ``commit_context()``."""
    def layer(x, qkv, proj):
        c = model.config
        points.layer_boundary(c)
        with points.offload("qkv_linear", c, x) as h:
            mixed = qkv(torch.tanh(h))
        with commit_context():
            mixed = points.commit("qkv_linear", commit_config, mixed)
        q, k, v = mixed.split(mixed.shape[-1] // 3, dim=-1)
        with points.offload("core_attn", c, q) as q:
            att = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        with commit_context():
            att = points.commit("core_attn", commit_config, att)
        with points.offload("attn_proj", c, att) as att:
            out = proj(att)
        with commit_context():
            out = points.commit("attn_proj", commit_config, out)
        return x + out
    return layer


@pytest.mark.parametrize("no_grad_commits", [False, True])
def test_commit_answers_like_handler_for_with_and_without_its_shortcut(monkeypatch, no_grad_commits):
    """commit() skips handler_for where the block's handler is the forward chunk's and the config its own; a copy of
    the config takes handler_for's way. Both must give the same groups, bytes and numbers, also where the commits
    run under no_grad (handler_for says no there: no group is committed, so nothing leaves the device)."""
    calls = []
    handler_for = type(get_manager()).handler_for

    def counting(self, config, name):
        calls.append(name)
        return handler_for(self, config, name)

    monkeypatch.setattr(type(get_manager()), "handler_for", counting)
    opened = []
    open_group = ChunkOffloadHandler.open_group
    monkeypatch.setattr(ChunkOffloadHandler, "open_group",
                        lambda self, name: opened.append(name) or open_group(self, name))
    outcomes = []
    for copy in (False, True):
        reset()
        calls.clear()
        opened.clear()
        model = Toy(cfg(*ATTN))
        commit_config = SimpleNamespace(**vars(model.config)) if copy else model.config
        model.layer = _layer_committing_with(model, commit_config,
                                             torch.no_grad if no_grad_commits else contextlib.nullcontext)
        inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        losses = train_step(model, inputs)
        last = get_summary().last_step
        outcomes.append(([loss.item() for loss in losses], [p.grad.clone() for p in model.parameters()],
                         len(opened), last and {p: dict(c) for p, c in last.points.items()}))
        # the shortcut asks handler_for nothing (offload() has one of its own); the copy asks it at every commit
        assert (len(calls) > 0) if copy else (calls == [])
        assert get_summary().host_resident_bytes == 0 and not get_manager().handlers
    (l0, g0, n0, b0), (l1, g1, n1, b1) = outcomes
    assert l0 == l1 and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert n0 == n1 and b0 == b1
    if no_grad_commits:  # no commit registers: each point opens a group of its own and none is offloaded
        assert n0 == 18 and b0 is None
    else:  # one chained group a layer (3 layers, 2 microbatches)
        assert n0 == 6 and b0["core_attn"]["offloaded"] > 0


def test_blocks_fall_back_to_the_hooks_context_where_torch_lacks_the_private_push(monkeypatch):
    base = run([])
    entered = []
    real = torch.autograd.graph.saved_tensors_hooks

    def counting(pack, unpack):
        entered.append(1)
        return real(pack, unpack)

    monkeypatch.setattr(points, "_push_hooks", None)
    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", counting)
    reset()
    got = run(ATTN)
    for (l0, g0), (l1, g1) in zip(base, got):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1)) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert len(entered) == 2 * 6 * 3  # 2 steps x 3 layers x 2 microbatches x 3 points
    assert get_summary().last_step.total("offloaded") > 0 and get_summary().host_resident_bytes == 0
