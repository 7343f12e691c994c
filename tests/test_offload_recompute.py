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


# (moe, recomputed modules, offloaded points). Only core_attn runs here: megatron-core 0.15.3 itself needs
# TransformerEngine on CUDA for the others (layernorm recompute's CheckpointWithoutOutput reads TE's FP8 state;
# moe_act recompute requires moe_grouped_gemm, i.e. TEGroupedMLP), and this CPU harness does not run on a GPU
# machine. layernorm, moe_act and core_attn recompute with the TE spec on the GPU host:
# tests/test_gpu.py::test_selective_recompute_with_the_neighbouring_points_offloaded_equal_loss.
CASES = [
    # core_attn itself is refused under its own recompute (tests/test_config.py): the checkpoint saves nothing
    (False, ["core_attn"], ["qkv_linear", "attn_proj"]),
]


@pytest.mark.parametrize(("moe", "modules", "points"), CASES,
                         ids=["+".join(m) + "__" + "+".join(p) for _, m, p in CASES])
def test_recompute_with_offloading_is_bitwise_equal(moe, modules, points):
    base = train(moe, recompute(*modules))
    got = train(moe, {**recompute(*modules), **offload(*points)})
    assert_bitwise(base, got)
    last = get_summary().last_step
    assert last is not None and last.total("offloaded") > 0
    assert last.total("released_in_forward") == last.total("offloaded") == last.total("reloaded")
