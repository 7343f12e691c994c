"""The offload points' forward glue in C++ (``runtime/native/points_block.cpp``: offload_block, Block, commit_point,
and the group hooks it registers) against points.py's Python glue (``MCORE_OFFLOAD_NATIVE_POINTS=0``): training steps
of the toy model open the same groups, count the same bytes per point and compute the same losses and gradients, bit
for bit, with chains and node hooks on or off; the C++ path is the one taken where it should be, and hands back to
Python where it should not decide (another config object, a tensor subclass)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from mcore_offload.runtime import native, points
from mcore_offload.runtime.handler import ChunkOffloadHandler
from mcore_offload.runtime.manager import OffloadManager, get_manager, reset
from mcore_offload.summary import get_summary
from tests.test_runtime_unit import Toy, cfg, run, train_step

ATTN = ["qkv_linear", "core_attn", "attn_proj"]


@pytest.fixture(autouse=True)
def built():
    if native.toolchain_missing():  # where the tools are there, a failed build fails the test
        pytest.skip(f"the C++ hooks cannot be built here: {native.toolchain_missing()}")
    native.reset()
    assert native.load_native() is not None
    yield
    native.reset()
    reset()


def _counted(monkeypatch, native_points: bool, body):
    """``body()`` with the points' glue in C++ or in Python; returns (its result, groups opened, the Python blocks and
    commits made, the last step's per-point counters)."""
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "1" if native_points else "0")
    reset()
    opened, python_calls = [], []
    open_group = ChunkOffloadHandler.open_group
    monkeypatch.setattr(ChunkOffloadHandler, "open_group", lambda self, name: opened.append(name) or open_group(
        self, name))
    block, commit = points._OffloadBlock, points._commit

    class CountedBlock(block):
        __slots__ = ()

        def __init__(self, *args, **kwargs):
            python_calls.append("block")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(points, "_OffloadBlock", CountedBlock)
    monkeypatch.setattr(points, "_commit", lambda *a: python_calls.append("commit") or commit(*a))
    result = body()
    last = get_summary().last_step
    counters = last and {p: dict(c) for p, c in last.points.items()}
    assert get_summary().host_resident_bytes == 0 and not get_manager().handlers and not get_manager().open_groups
    monkeypatch.undo()
    return result, opened, python_calls, counters


def _equal(a, b):
    for (l0, g0), (l1, g1) in zip(a, b, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(l0, l1, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(g0, g1, strict=True))


@pytest.mark.parametrize("names", [ATTN, ["qkv_linear"], ["core_attn", "attn_proj"], ["qkv_linear", "core_attn"]])
@pytest.mark.parametrize("chaining", ["1", "0"])
@pytest.mark.parametrize("node_hooks", ["1", "0"])
def test_the_cpp_glue_opens_the_same_groups_and_counts_the_same_bytes(monkeypatch, names, chaining, node_hooks):
    base = run([])
    outcomes = []
    for native_points in (True, False):
        def body():
            monkeypatch.setenv("MCORE_OFFLOAD_CHAIN_POINTS", chaining)
            monkeypatch.setenv("MCORE_OFFLOAD_NODE_HOOKS", node_hooks)
            reset()
            return run(names, steps=3)
        outcomes.append(_counted(monkeypatch, native_points, body))
    (r1, opened1, py1, c1), (r0, opened0, py0, c0) = outcomes
    _equal(base, r1[:2])
    _equal(r0, r1)
    assert opened1 == opened0 and c1 == c0
    assert c1["core_attn" if "core_attn" in names else names[0]]["offloaded"] > 0
    # the C++ path took every point of the toy's own config; the Python path made a block per point and layer
    assert py1 == [] and py0.count("block") == 3 * 3 * 2 * len(names)


def test_another_config_object_goes_to_the_python_glue(monkeypatch):
    """A commit given a copy of the chunk's config is handler_for's question: commit_point steps aside."""
    def body():
        model = Toy(cfg(*ATTN))
        copy = SimpleNamespace(**vars(model.config))
        real_commit = points.commit

        def layer(x, qkv, proj):
            points.layer_boundary(model.config)
            with points.offload("qkv_linear", model.config, x) as h:
                mixed = qkv(torch.tanh(h))
            mixed = real_commit("qkv_linear", copy, mixed)
            q, k, v = mixed.split(16, dim=-1)
            with points.offload("core_attn", model.config, q) as q:
                att = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
            att = real_commit("core_attn", copy, att)
            with points.offload("attn_proj", model.config, att) as att:
                out = proj(att)
            return x + real_commit("attn_proj", copy, out)

        model.layer = layer
        inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        return [(train_step(model, inputs), [p.grad.clone() for p in model.parameters()])]

    (r1, opened1, py1, c1), (r0, opened0, py0, c0) = (_counted(monkeypatch, n, body) for n in (True, False))
    _equal(r0, r1)
    assert opened1 == opened0 and c1 == c0 and c1["core_attn"]["offloaded"] > 0
    # blocks in C++ (the chunk's own config), every commit in Python (the copy)
    assert py1.count("block") == 0 and py1.count("commit") == 3 * 3 * 2


def test_a_tuple_output_and_a_leaf_output_commit_alike(monkeypatch):
    """commit() of a (tensor, extra) tuple, and of an output without a node (an identity node of ours then carries
    the commit): the same values and the same tuple shape either way."""
    def body():
        model = Toy(cfg("core_attn"))
        shapes = []

        def layer(x, qkv, proj):
            points.layer_boundary(model.config)
            mixed = qkv(torch.tanh(x))
            q, k, v = mixed.split(16, dim=-1)
            with points.offload("core_attn", model.config, q) as q:
                att = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
            # a leaf that requires grad has no node to hook: the commit's own identity node
            leaf = torch.zeros_like(att).requires_grad_()
            out = points.commit("core_attn", model.config, (att + leaf, leaf))
            shapes.append(type(out).__name__)
            return x + proj(out[0])

        model.layer = layer
        inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        return [(train_step(model, inputs), [p.grad.clone() for p in model.parameters()])], shapes

    ((r1, s1), _, py1, c1), ((r0, s0), _, _, c0) = (_counted(monkeypatch, n, body) for n in (True, False))
    _equal(r0, r1)
    assert s1 == s0 == ["tuple"] * 6 and c1 == c0 and c1["core_attn"]["offloaded"] > 0 and py1 == []


def _recording(method, names: list[str]):
    """``method`` (a manager method taking a point name first) that also appends the name to ``names``."""
    def wrapper(self, name, *args):
        names.append(name)
        return method(self, name, *args)
    return wrapper


def test_a_point_that_saves_nothing_is_reported_once_either_way(monkeypatch, caplog):
    def body():
        model = Toy(cfg("qkv_linear"))

        def layer(x, qkv, proj):
            points.layer_boundary(model.config)
            with points.offload("qkv_linear", model.config, x) as h:
                h = h + 1  # an addition saves nothing for backward
            h = points.commit("qkv_linear", model.config, h)
            return x + proj(torch.tanh(h))

        model.layer = layer
        inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        return [(train_step(model, inputs), [p.grad.clone() for p in model.parameters() if p.grad is not None])]

    lines, results, reports = [], [], []
    for n in (True, False):
        caplog.clear()
        reported: list[str] = []
        # after the line is logged, the exits skip building its arguments (six exits, one report)
        monkeypatch.setattr(OffloadManager, "point_saved_nothing",
                            _recording(OffloadManager.point_saved_nothing, reported))
        with caplog.at_level(logging.INFO, logger="mcore_offload"):
            results.append(_counted(monkeypatch, n, body))
        lines.append([r.getMessage() for r in caplog.records if "saved no tensor" in r.getMessage()])
        reports.append(reported)
    _equal(results[0][0], results[1][0])
    assert results[0][2] == [] and results[1][2].count("block") == 3 * 2
    assert lines[0] == lines[1] and len(lines[0]) == 1 and "qkv_linear" in lines[0][0]
    assert reports == [["qkv_linear"], ["qkv_linear"]]


def test_a_tensor_subclass_input_goes_to_the_python_block(monkeypatch):
    class Marked(torch.Tensor):
        pass

    def body():
        model = Toy(cfg("qkv_linear"))
        real_layer = model.layer

        def layer(x, qkv, proj):
            return real_layer(x.as_subclass(Marked) if x.requires_grad else x, qkv, proj)

        model.layer = layer
        inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        return [(train_step(model, inputs), [p.grad.clone() for p in model.parameters()])]

    (r1, opened1, py1, c1), (r0, opened0, _, c0) = (_counted(monkeypatch, n, body) for n in (True, False))
    _equal(r0, r1)
    assert opened1 == opened0 and c1 == c0
    # layers 2 and 3 of each microbatch get a subclass input: their qkv_linear blocks are Python's
    assert py1.count("block") == 2 * 2


def test_the_runtime_switch_turns_the_cpp_glue_on_and_off(monkeypatch):
    """``pretrain_gpt.py --alternate-runtime native_points=off``: the Python glue in the steps under test, the C++ one
    (the manager's own) in the others."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import runtime_switch

    manager = get_manager()
    assert manager.native_points is manager.native is not None
    switch = runtime_switch.RuntimeSwitch(runtime_switch.parse_settings(["native_points=off"]))
    switch.start_step(under_test=True)
    assert manager.native_points is None
    switch.end_step()
    switch.start_step(under_test=False)
    assert manager.native_points is manager.native
    switch.end_step()
    assert switch.defaults == {"native_points": "on"}
    assert switch.held == [{"native_points": "off"}, {"native_points": "on"}]
    with pytest.raises(ValueError, match="native_points must be one of on, off"):
        runtime_switch.parse_settings(["native_points=1"])


@pytest.mark.parametrize("native_points", [True, False])
def test_a_failure_inside_the_glue_leaves_no_state_either_way(monkeypatch, native_points):
    """A Python call the glue makes fails (here the group's opening, in the second layer): the error reaches the
    caller unchanged, the hooks pushed so far are popped, and the step boundary leaves nothing behind."""
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "1" if native_points else "0")
    reset()
    model = Toy(cfg(*ATTN))
    opened = []
    open_group = ChunkOffloadHandler.open_group

    def failing(self, name):
        opened.append(name)
        if len(opened) == 2:
            raise RuntimeError("injected in open_group")
        return open_group(self, name)

    monkeypatch.setattr(ChunkOffloadHandler, "open_group", failing)
    with pytest.raises(RuntimeError, match="injected in open_group"):
        train_step(model, [torch.randn(8, 16)])
    manager = get_manager()
    assert not manager.handlers and not manager.open_groups and manager.chain is None
    assert get_summary().host_resident_bytes == 0
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is not None:  # no saved-tensor hooks left pushed
        assert top(False) is None


@pytest.mark.parametrize("native_points", [True, False])
def test_a_failure_inside_a_blocks_body_pops_its_hooks_either_way(monkeypatch, native_points):
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "1" if native_points else "0")
    reset()
    model = Toy(cfg(*ATTN))
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    inside = []

    def layer(x, qkv, proj):
        points.layer_boundary(model.config)
        with points.offload("qkv_linear", model.config, x) as h:
            inside.append(top(False) if top is not None else "pushed")
            qkv(torch.tanh(h))
            raise RuntimeError("injected in a block's body")

    model.layer = layer
    with pytest.raises(RuntimeError, match="injected in a block's body"):
        train_step(model, [torch.randn(8, 16)])
    assert inside and inside[0] is not None
    if top is not None:
        assert top(False) is None
    manager = get_manager()
    assert not manager.handlers and not manager.open_groups and get_summary().host_resident_bytes == 0
