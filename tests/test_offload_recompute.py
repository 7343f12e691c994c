"""Selective recompute combined with offloading of the neighbouring points (CPU, local spec, gloo): loss
and every gradient bitwise equal to the same recompute configuration without offloading; and why the points
that a recompute wraps in ``CheckpointWithoutOutput`` are refused (``mcore_offload.config``)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from mcore_offload.summary import get_summary
from tests.harness.gpt import build_dense_gpt, build_moe_gpt, init_parallel, run_steps
from tests.test_offload_megatron import DENSE_POINTS, MOE_POINTS, assert_bitwise, offload, train

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def _parallel():
    init_parallel()
    yield


class _NoFP8:
    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe() -> None:
        return None


@pytest.fixture
def checkpoint_without_te(monkeypatch):
    """megatron-core 0.15.3's CheckpointWithoutOutput always takes its FP8 path (``self.fp8 = fp8 is not
    None``), which calls TransformerEngine; without TE (CPU) stand in the three names it uses with no-ops."""
    import megatron.core.tensor_parallel.random as random

    if not hasattr(random, "FP8GlobalStateManager"):
        monkeypatch.setattr(random, "FP8GlobalStateManager", _NoFP8, raising=False)
        monkeypatch.setattr(random, "activation_recompute_forward", lambda **_: contextlib.nullcontext(),
                            raising=False)
        monkeypatch.setattr(random, "fp8_autocast", lambda **_: contextlib.nullcontext(), raising=False)


def recompute(*modules: str) -> dict[str, Any]:
    return dict(recompute_granularity="selective", recompute_modules=list(modules))


# (moe, recomputed modules, offloaded points): each recompute module with the points around it that it does
# not wrap (core_attn under core_attn recompute, the norms under layernorm recompute, moe_act under moe_act
# recompute are refused: tests/test_config.py). moe_act recompute needs TEGroupedMLP: GPU suite only.
CASES = [
    (False, ["core_attn"], ["qkv_linear", "attn_proj"]),
    (False, ["layernorm"], ["qkv_linear", "core_attn", "attn_proj"]),
    (True, ["layernorm"], ["qkv_linear", "expert_fc1", "moe_act"]),
]


@pytest.mark.usefixtures("checkpoint_without_te")
@pytest.mark.parametrize(("moe", "modules", "points"), CASES,
                         ids=["+".join(m) + "__" + "+".join(p) for _, m, p in CASES])
def test_recompute_with_offloading_is_bitwise_equal(moe, modules, points):
    base = train(moe, recompute(*modules))
    got = train(moe, {**recompute(*modules), **offload(*points)})
    assert_bitwise(base, got)
    last = get_summary().last_step
    assert last is not None and last.total("offloaded") > 0
    assert last.total("released_in_forward") == last.total("offloaded") == last.total("reloaded")


@pytest.mark.usefixtures("checkpoint_without_te")
def test_saved_tensor_hooks_around_checkpoint_without_output_lose_its_input_gradient():
    """Why attn_norm / mlp_norm under layernorm recompute and moe_act under moe_act recompute are refused:
    even identity hooks make the checkpoint's backward read ``.grad`` of a fresh tensor object (None)."""
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    def grad_of_input(hooks: bool) -> torch.Tensor | None:
        x = torch.linspace(-1.0, 1.0, 8, requires_grad=True)
        ckpt = CheckpointWithoutOutput()
        ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooks else contextlib.nullcontext()
        with ctx:
            h = ckpt.checkpoint(torch.tanh, x)
        out = h * 3.0
        ckpt.discard_output_and_register_recompute(out)
        out.sum().backward()
        return x.grad

    expected = 3.0 * (1 - torch.tanh(torch.linspace(-1.0, 1.0, 8)) ** 2)
    assert torch.allclose(grad_of_input(False), expected)
    assert grad_of_input(True) is None


def _last_step_bytes() -> dict[str, int]:
    last = get_summary().last_step
    assert last is not None
    return {name: counts["offloaded"] for name, counts in last.points.items()}


def _bytes_per_point(moe: bool, layers: int, overrides: dict[str, Any]) -> dict[str, int]:
    """Bytes per point of one step of 2 microbatches (as ``train``'s steps) on a model of ``layers`` layers."""
    build = build_moe_gpt if moe else build_dense_gpt
    chunks = build(num_layers=layers, config_overrides=overrides)
    run_steps(chunks, n_steps=2, num_microbatches=2, seq_len=16, micro_batch_size=2, lr=0.1)
    return _last_step_bytes()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_block_recompute_of_the_first_layers_offloads_the_others_bitwise_equal(moe):
    """Full recompute with ``recompute_method='block'`` checkpoints the first ``recompute_num_layers`` layers of
    each chunk: their forward runs without grad (no offload point opens) and their recompute runs inside backward
    (never offloaded), so only the other layers move. With one of three layers checkpointed, each point moves
    exactly what the middle layer moves without recompute (three layers less two: at PP = 1 the last layer stays
    on the device), and loss and gradients equal the same recompute without offloading."""
    points = MOE_POINTS if moe else DENSE_POINTS
    block = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    base = train(moe, block)
    got = train(moe, {**block, **offload(*points)})  # three layers, two microbatches a step
    assert_bitwise(base, got)
    moved = _last_step_bytes()
    three = _bytes_per_point(moe, 3, offload(*points))
    two = _bytes_per_point(moe, 2, offload(*points))
    middle = {p: three[p] - two[p] for p in points}
    assert all(middle[p] > 0 for p in points), middle
    assert moved == middle


def block_recompute_pipelined_job(rank: int, world_size: int) -> dict[str, Any]:
    """Worker: PP=2 x VPP=2, two layers a chunk with the first checkpointed (block method), with and without every
    dense point offloaded."""
    init_parallel(world_size, rank, pp=2, vpp=2)
    block = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    kw = dict(n_steps=2, num_microbatches=4, seq_len=16, micro_batch_size=2, lr=0.1)
    base = run_steps(build_dense_gpt(num_layers=8, config_overrides=block), **kw)
    got = run_steps(build_dense_gpt(num_layers=8, config_overrides={**block, **offload(*DENSE_POINTS)}), **kw)
    last = get_summary().last_step
    return {"base": base, "offload": got,
            **{c: last.total(c) for c in ("offloaded", "released_in_forward", "reloaded", "reloaded_on_demand")}}


@pytest.mark.multiproc
def test_block_recompute_under_interleaved_pipelining_is_bitwise_equal():
    """Each chunk checkpoints its first layer, so only its last layer saves activations: it moves only where the
    chunk does not turn around (flushed when the next chunk starts), and comes back with the chunk's backward."""
    from tests.harness.multiproc import run_multiprocess

    for r in run_multiprocess(block_recompute_pipelined_job, 2, timeout_s=240):
        assert_bitwise(r["base"], r["offload"])
        assert r["offloaded"] > 0 and r["released_in_forward"] == r["offloaded"] == r["reloaded"]
        assert r["reloaded_on_demand"] == 0
