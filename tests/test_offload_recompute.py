"""Selective recompute combined with offloading of the neighbouring points (CPU, local spec, gloo): loss
and every gradient bitwise equal to the same recompute configuration without offloading."""

from __future__ import annotations

from typing import Any

import pytest

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


def recompute(*modules: str) -> dict[str, Any]:
    return dict(recompute_granularity="selective", recompute_modules=list(modules))


# (moe, recomputed modules, offloaded points): each recompute module with the points around it.
CASES = [
    (False, ["core_attn"], ["qkv_linear", "attn_proj", "core_attn"]),
    (False, ["layernorm"], ["attn_norm", "qkv_linear", "mlp_norm"]),
    (True, ["moe_act"], ["expert_fc1", "moe_act"]),
    (True, ["layernorm", "moe_act"], ["mlp_norm", "expert_fc1", "qkv_linear"]),
]


@pytest.mark.parametrize(("moe", "modules", "points"), CASES,
                         ids=["+".join(m) + "__" + "+".join(p) for _, m, p in CASES])
def test_recompute_with_offloading_is_bitwise_equal(moe, modules, points):
    if "layernorm" in modules or "moe_act" in modules:
        # megatron-core 0.15.3 itself needs TransformerEngine here, with or without offloading: layernorm
        # recompute's CheckpointWithoutOutput reads TE's FP8 state, and moe_act recompute requires
        # moe_grouped_gemm (TEGroupedMLP). These cases run on the GPU host.
        pytest.importorskip("transformer_engine")
    base = train(moe, recompute(*modules))
    got = train(moe, {**recompute(*modules), **offload(*points)})
    assert_bitwise(base, got)
    last = get_summary().last_step
    assert last is not None and last.total("offloaded") > 0
    assert last.total("released_in_forward") == last.total("offloaded") == last.total("reloaded")
