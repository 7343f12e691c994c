"""PP=2 and PP=2+VPP=2 through megatron-core's real pipeline schedules, 2 gloo processes on CPU.

Every layout builds the same model (layout-independent init), so each must reproduce the PP=1 run
bit for bit: losses and every parameter's gradient, over two SGD steps.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.harness.gpt import RunResult
from tests.harness.multiproc import run_multiprocess

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
]

NUM_LAYERS = 4
NUM_MICROBATCHES = 4


def pipeline_job(
    rank: int,
    world_size: int,
    pp: int,
    vpp: int | None,
    moe: bool = False,
    overrides: dict[str, Any] | None = None,
    repeats: int = 2,
) -> dict[str, Any]:
    """Worker: build the model ``repeats`` times from scratch, run 2 steps each, report."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.harness.gpt import build_dense_gpt, build_moe_gpt, init_parallel, run_steps

    init_parallel(world_size, rank, pp=pp, vpp=vpp)
    build = build_moe_gpt if moe else build_dense_gpt
    runs = []
    for _ in range(repeats):
        chunks = build(num_layers=NUM_LAYERS, config_overrides=overrides)
        runs.append(
            run_steps(
                chunks,
                n_steps=2,
                num_microbatches=NUM_MICROBATCHES,
                seq_len=16,
                micro_batch_size=2,
                lr=0.1,
            )
        )
    return {"schedule": get_forward_backward_func().__name__, "runs": runs}


def _merge(per_rank: list[dict[str, Any]], run: int) -> RunResult:
    """One RunResult for the whole model: grads of all ranks merged (names are global)."""
    losses = per_rank[0]["runs"][run].losses
    assert all(r["runs"][run].losses == losses for r in per_rank)  # broadcast from the last stage
    merged = RunResult(losses=list(losses), grads=[{} for _ in losses])
    for result in per_rank:
        for step, grads in enumerate(result["runs"][run].grads):
            assert not merged.grads[step].keys() & grads.keys()
            merged.grads[step].update(grads)
    return merged


def _assert_identical(a: RunResult, b: RunResult) -> None:
    assert a.losses == b.losses
    for grads_a, grads_b in zip(a.grads, b.grads, strict=True):
        assert grads_a.keys() == grads_b.keys()
        for name, grad in grads_a.items():
            assert grad is not None and torch.isfinite(grad).all(), name
            assert torch.equal(grad, grads_b[name]), name


@pytest.fixture(scope="module")
def reference() -> dict[bool, RunResult]:
    """PP=1 runs (one process, same thread count as the workers), dense and MoE."""
    out = {}
    for moe in (False, True):
        (result,) = run_multiprocess(pipeline_job, 1, args=(1, None, moe, None, 1))
        assert result["schedule"] == "forward_backward_no_pipelining"
        out[moe] = _merge([result], 0)
    return out


@pytest.mark.parametrize(
    ("pp", "vpp", "moe", "schedule"),
    [
        (2, None, False, "forward_backward_pipelining_without_interleaving"),
        (2, 2, False, "forward_backward_pipelining_with_interleaving"),
        (2, 2, True, "forward_backward_pipelining_with_interleaving"),
    ],
    ids=["pp2-dense", "pp2-vpp2-dense", "pp2-vpp2-moe"],
)
def test_pipeline_matches_pp1_and_is_deterministic(reference, pp, vpp, moe, schedule):
    per_rank = run_multiprocess(pipeline_job, 2, args=(pp, vpp, moe))
    assert all(r["schedule"] == schedule for r in per_rank)
    first, second = _merge(per_rank, 0), _merge(per_rank, 1)
    assert all(math.isfinite(x) for x in first.losses)
    _assert_identical(first, second)
    _assert_identical(first, reference[moe])


def test_vpp_with_pp2_and_batched_p2p_is_silently_wrong(reference):
    """megatron-core's default p2p settings (batch_p2p_comm=True, overlap_p2p_comm=False) at PP=2
    with VPP pair each send with the wrong receive (README.md); the harness defaults avoid it."""
    bad = {"batch_p2p_comm": True, "overlap_p2p_comm": False}
    per_rank = run_multiprocess(pipeline_job, 2, args=(2, 2, False, bad, 1))
    result = _merge(per_rank, 0)
    assert all(math.isfinite(x) for x in result.losses)
    assert result.losses != reference[False].losses
