"""The CPU harness runs real megatron-core GPTModels through get_forward_backward_func()."""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness import cpu_shims
from tests.harness.gpt import (
    RunResult,
    build_dense_gpt,
    build_moe_gpt,
    init_parallel,
    run_steps,
    teardown_parallel,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore::UserWarning:megatron"),
]

BUILDERS = {"dense": build_dense_gpt, "moe": build_moe_gpt}


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    """A gloo world of one rank with TP=PP=1 for the whole module."""
    init_parallel()
    yield
    teardown_parallel()
    cpu_shims.remove_cpu_shims()


def _run(kind: str, overrides: dict | None = None, *, lr: float | None = 0.1) -> RunResult:
    chunks = BUILDERS[kind](config_overrides=overrides)
    return run_steps(chunks, n_steps=2, num_microbatches=2, seq_len=16, micro_batch_size=2, lr=lr)


def _assert_identical(a: RunResult, b: RunResult) -> None:
    assert a.losses == b.losses
    for grads_a, grads_b in zip(a.grads, b.grads, strict=True):
        assert grads_a.keys() == grads_b.keys()
        for name, grad in grads_a.items():
            assert torch.equal(grad, grads_b[name]), name


def test_schedule_is_the_real_no_pipelining_one():
    from megatron.core.pipeline_parallel import get_forward_backward_func

    assert get_forward_backward_func().__name__ == "forward_backward_no_pipelining"


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_forward_backward_gives_finite_loss_and_grads_for_every_param(kind):
    chunks = BUILDERS[kind]()
    result = run_steps(chunks, n_steps=2, num_microbatches=2, seq_len=16, micro_batch_size=2)
    assert len(result.losses) == 2 and all(math.isfinite(x) for x in result.losses)
    # an untrained model over a 128-token vocabulary: cross-entropy close to ln(128)
    assert abs(result.losses[0] - math.log(128)) < 0.5
    param_names = {name for name, _ in chunks[0].named_parameters()}
    for grads in result.grads:
        assert grads.keys() == param_names
        missing = [name for name, grad in grads.items() if grad is None]
        assert not missing, missing
        assert all(torch.isfinite(grad).all() for grad in grads.values())
    if kind == "moe":
        from megatron.core.transformer.moe.experts import SequentialMLP

        assert isinstance(chunks[0].decoder.layers[0].mlp.experts, SequentialMLP)
        expert_grads = [g for n, g in result.grads[0].items() if ".local_experts." in n]
        router_grads = [g for n, g in result.grads[0].items() if ".router." in n]
        assert expert_grads and router_grads
        assert all(g.abs().sum() > 0 for g in router_grads)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_two_runs_are_bitwise_identical(kind):
    first, second = _run(kind), _run(kind)
    _assert_identical(first, second)
    # the SGD step (lr=0.1) made step 2 differ from step 1
    assert first.losses[0] != first.losses[1]


def test_no_lr_leaves_parameters_unchanged():
    chunks = build_dense_gpt()
    before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    run_steps(chunks, n_steps=1, num_microbatches=1, seq_len=8, micro_batch_size=1)
    assert all(torch.equal(p, before[n]) for n, p in chunks[0].named_parameters())


def test_config_overrides_reach_transformer_config():
    chunks = build_dense_gpt(config_overrides={"hidden_dropout": 0.25, "num_query_groups": 2})
    assert chunks[0].config.hidden_dropout == 0.25
    assert chunks[0].config.num_query_groups == 2
    with pytest.raises(TypeError, match="not_a_transformer_config_field"):
        build_dense_gpt(config_overrides={"not_a_transformer_config_field": True})


def test_dropout_and_recompute_reproduce_masks_through_the_cpu_rng_tracker():
    dropout = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
    plain = _run("dense", dropout)
    assert plain.losses != _run("dense").losses  # dropout is active
    _assert_identical(plain, _run("dense", dropout))
    # Recompute restores the forked RNG states; bitwise-equal grads prove the masks were replayed.
    for recompute in (
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "selective"},
    ):
        _assert_identical(plain, _run("dense", {**dropout, **recompute}))


def test_rope_runs():
    chunks = build_dense_gpt(position_embedding_type="rope")
    result = run_steps(chunks, n_steps=1, num_microbatches=2, seq_len=16, micro_batch_size=2)
    assert math.isfinite(result.losses[0])


def test_shims_are_idempotent_and_removable():
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import GlobalMemoryBuffer

    assert cpu_shims.shims_installed()
    count = len(cpu_shims._PATCHES)
    cpu_shims.install_cpu_shims()
    assert len(cpu_shims._PATCHES) == count
    shimmed = GlobalMemoryBuffer.get_tensor
    cpu_shims.remove_cpu_shims()
    try:
        assert not cpu_shims.shims_installed()
        assert schedules.torch is torch
        assert GlobalMemoryBuffer.get_tensor is not shimmed
        with cpu_shims.cpu_shims():
            assert schedules.torch is not torch
        assert schedules.torch is torch
    finally:
        cpu_shims.install_cpu_shims()
    assert GlobalMemoryBuffer.get_tensor is shimmed
