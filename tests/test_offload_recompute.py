"""Selective recompute combined with offloading of the neighbouring points (CPU, local spec, gloo): loss
and every gradient bitwise equal to the same recompute configuration without offloading; and why the points
that a recompute wraps in ``CheckpointWithoutOutput`` are refused (``mcore_offload.config``)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from mcore_offload.summary import get_summary
from tests.harness.gpt import init_parallel
from tests.test_offload_megatron import assert_bitwise, offload, train

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
