"""Offloading inside real megatron-core 0.15.3 GPTModels on CPU (patched local spec, gloo), through
``get_forward_backward_func()``: bitwise equality with the no-offload run, and exact byte accounting."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_offload.runtime.manager import get_manager
from mcore_offload.summary import get_summary
from tests.harness.gpt import RunResult, build_dense_gpt, build_moe_gpt, init_parallel, run_steps
from tests.harness.multiproc import run_multiprocess

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

DENSE_POINTS = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]
MOE_POINTS = DENSE_POINTS + ["expert_fc1", "moe_act"]
STEPS, MICROBATCHES, LAYERS = 3, 2, 3


def offload(*names: str) -> dict[str, Any]:
    # 512 elements: every activation of these tiny models, but not the router probabilities (64
    # elements), whose storage the MoE dispatcher keeps through an object our alias check cannot see
    # (a known limitation, irrelevant at the default threshold of 1M elements).
    return dict(fine_grained_activation_offloading=True, offload_modules=list(names),
                min_offloaded_tensor_size=512)


@pytest.fixture(scope="module", autouse=True)
def _parallel():
    init_parallel()
    yield


def train(moe: bool, overrides: dict[str, Any] | None) -> RunResult:
    build = build_moe_gpt if moe else build_dense_gpt
    chunks = build(num_layers=LAYERS, config_overrides=overrides)
    return run_steps(chunks, n_steps=STEPS, num_microbatches=MICROBATCHES, seq_len=16,
                     micro_batch_size=2, lr=0.1)


def assert_bitwise(a: RunResult, b: RunResult) -> None:
    assert a.losses == b.losses
    for ga, gb in zip(a.grads, b.grads, strict=True):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name


_baselines: dict[bool, RunResult] = {}


def baseline(moe: bool) -> RunResult:
    if moe not in _baselines:
        _baselines[moe] = train(moe, None)
    return _baselines[moe]


CASES = ([(False, [p]) for p in DENSE_POINTS] + [(False, DENSE_POINTS)]
         + [(True, [p]) for p in MOE_POINTS] + [(True, MOE_POINTS)])


@pytest.mark.parametrize(("moe", "points"), CASES,
                         ids=[("moe-" if m else "dense-") + "+".join(p) for m, p in CASES])
def test_bitwise_equal_and_every_offloaded_byte_released_and_restored(moe, points):
    if points == ["attn_proj"]:
        points = ["core_attn", "attn_proj"]  # attn_proj alone is a configuration error
    early = get_manager().early_flushes
    result = train(moe, offload(*points))
    assert get_manager().early_flushes == early  # no pipelining: every chunk turns around
    assert_bitwise(baseline(moe), result)
    summary = get_summary()
    assert len(summary.steps) == STEPS and not any(s.aborted for s in summary.steps)
    for step in summary.steps:
        for name in points:
            counters = step.points.get(name)
            assert counters and counters["offloaded"] > 0, f"{name} offloaded nothing"
        offloaded = step.total("offloaded")
        assert step.total("released_in_forward") == offloaded  # the device really got it back
        assert step.total("reloaded") == offloaded  # and all of it came back for backward
        assert step.total("reloaded_on_demand") == 0  # each reload started before its group's backward
        assert step.total("kept_on_device") > 0  # no pipelining: every chunk turns around, nothing leaves early
        # one forward end a microbatch, though the runtime releases copied blocks there up to three times (end_chunk,
        # the output's gradient, the last group's backward): the trailing warning divides by this count
        assert step.forward_ends == MICROBATCHES
    assert summary.host_resident_bytes == 0
    assert not get_manager().handlers


def test_eval_and_no_grad_between_steps_offload_nothing():
    chunks = build_dense_gpt(num_layers=LAYERS, config_overrides=offload(*DENSE_POINTS))
    ref_chunks = build_dense_gpt(num_layers=LAYERS)
    kw = dict(n_steps=1, num_microbatches=MICROBATCHES, seq_len=16, micro_batch_size=2, lr=0.1)
    first, ref_first = run_steps(chunks, **kw), run_steps(ref_chunks, **kw)
    steps_before = len(get_summary().steps)
    for c in chunks:
        c.eval()
    run_steps(chunks, n_steps=1, num_microbatches=MICROBATCHES, seq_len=16, micro_batch_size=2,
              forward_only=True)
    for c in chunks:
        c.train()
    run_steps(chunks, n_steps=1, num_microbatches=MICROBATCHES, seq_len=16, micro_batch_size=2,
              forward_only=True)  # training mode, but no_grad and forward_only
    assert len(get_summary().steps) == steps_before  # nothing was offloaded or recorded
    assert not get_manager().handlers and get_manager().forward_handler is None
    second, ref_second = run_steps(chunks, **kw), run_steps(ref_chunks, **kw)
    assert_bitwise(first, ref_first)
    assert_bitwise(second, ref_second)
    assert get_summary().last_step.total("offloaded") > 0


def test_exception_inside_a_forward_mid_step_leaves_no_state():
    chunks = build_dense_gpt(num_layers=LAYERS, config_overrides=offload(*DENSE_POINTS))
    ref = build_dense_gpt(num_layers=LAYERS)
    layer = chunks[0].decoder.layers[1].self_attention
    original = layer.forward
    calls = {"n": 0}

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # second microbatch: the first one's groups are already offloaded
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    layer.forward = failing_forward
    kw = dict(n_steps=1, num_microbatches=MICROBATCHES, seq_len=16, micro_batch_size=2)
    with pytest.raises(RuntimeError, match="injected fault"):
        run_steps(chunks, **kw)
    layer.forward = original
    manager = get_manager()
    assert not manager.handlers and manager.forward_handler is None and not manager.open_groups
    assert get_summary().last_step.aborted and get_summary().host_resident_bytes == 0
    result = run_steps(chunks, **kw)
    assert_bitwise(result, run_steps(ref, **kw))
    assert get_summary().last_step.total("offloaded") > 0 and not get_summary().last_step.aborted


def interleaved_job(rank: int, world_size: int, points: list[str]) -> dict[str, Any]:
    """Worker: PP=2 x VPP=2, the same model with and without offloading."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    init_parallel(world_size, rank, pp=2, vpp=2)
    out = {"schedule": get_forward_backward_func().__name__}
    # deallocate_pipeline_outputs (Megatron-LM's default) empties each chunk's output tensor after sending it:
    # end_chunk's gradient hook must still fire. On this CPU/gloo harness that option changes the losses even
    # without offloading (seen: step 2 differs), so that run is checked for its byte counts only.
    runs = (("base", None), ("offload", offload(*points)),
            ("offload_dealloc", dict(offload(*points), deallocate_pipeline_outputs=True)))
    for key, overrides in runs:
        chunks = build_dense_gpt(num_layers=8, config_overrides=overrides)
        early = get_manager().early_flushes
        out[key] = run_steps(chunks, n_steps=STEPS, num_microbatches=4, seq_len=16,
                             micro_batch_size=2, lr=0.1)
        if overrides:
            last = get_summary().last_step
            out[key + "_bytes"] = {c: last.total(c) for c in
                                   ("offloaded", "released_in_forward", "reloaded", "reloaded_on_demand")}
            out[key + "_kept"] = [s.total("kept_on_device") for s in get_summary().steps[-STEPS:]]
            out[key + "_early"] = get_manager().early_flushes - early
    return out


@pytest.mark.multiproc
def test_interleaved_pp2_vpp2_bitwise_equal():
    results = run_multiprocess(interleaved_job, 2, args=(DENSE_POINTS,), timeout_s=180)
    for r in results:
        assert r["schedule"] == "forward_backward_pipelining_with_interleaving"
        assert_bitwise(r["base"], r["offload"])
        for key in ("offload", "offload_dealloc"):
            b = r[key + "_bytes"]
            assert b["offloaded"] > 0 and b["released_in_forward"] == b["offloaded"] == b["reloaded"]
            # every chunk's last layer leaves the device while other chunks run forward; its reload starts when
            # the chunk's output gradient arrives (end_chunk), every other group's with the backward after it
            assert b["reloaded_on_demand"] == 0, (key, b)
            # from the second step on, chunks whose backward did not follow their forward flush their last layer
            # at end_chunk; what turns around keeps its last layer, as in the first step
            assert r[key + "_early"] > 0
            kept = r[key + "_kept"]
            assert kept == [kept[0]] * len(kept), kept


def test_number_of_microbatches_may_change_between_steps():
    chunks = build_dense_gpt(num_layers=LAYERS, config_overrides=offload(*DENSE_POINTS))
    ref = build_dense_gpt(num_layers=LAYERS)
    for n in (2, 3, 1, 4):
        kw = dict(n_steps=1, num_microbatches=n, seq_len=16, micro_batch_size=2, lr=0.1, data_seed=n)
        assert_bitwise(run_steps(chunks, **kw), run_steps(ref, **kw))
        last = get_summary().last_step
        assert last.total("reloaded") == last.total("offloaded") > 0
        assert not get_manager().handlers


def pipelined_job(rank: int, world_size: int, vpp: int | None, microbatches: int) -> dict[str, Any]:
    """Worker: PP=2 (with or without VPP), the same model with and without every dense point offloaded."""
    init_parallel(world_size, rank, pp=2, vpp=vpp)
    kw = dict(n_steps=STEPS, num_microbatches=microbatches, seq_len=16, micro_batch_size=2, lr=0.1)
    base = run_steps(build_dense_gpt(num_layers=8), **kw)
    early = get_manager().early_flushes
    result = run_steps(build_dense_gpt(num_layers=8, config_overrides=offload(*DENSE_POINTS)), **kw)
    steps = get_summary().steps[-STEPS:]
    counters = ("offloaded", "reloaded", "reloaded_on_demand", "kept_on_device")
    return {"base": base, "offload": result, "early": get_manager().early_flushes - early,
            **{c: [s.total(c) for s in steps] for c in counters}}


@pytest.mark.multiproc
@pytest.mark.parametrize(("vpp", "microbatches"), [(None, 4), (2, 8)], ids=["1f1b", "interleaved-8mb"])
def test_pipelined_chunks_that_turn_around_keep_their_last_layer_the_others_flush_it_at_end_chunk(vpp, microbatches):
    ranks = run_multiprocess(pipelined_job, 2, args=(vpp, microbatches), timeout_s=180)
    for r in ranks:
        assert_bitwise(r["base"], r["offload"])
        assert r["offloaded"] == r["reloaded"] and min(r["offloaded"]) > 0
        assert r["reloaded_on_demand"] == [0] * STEPS
        # the first step learns which chunks turn around; later steps keep exactly what it kept
        assert r["kept_on_device"] == [r["kept_on_device"][0]] * STEPS
    first, last = ranks
    assert first["early"] > 0  # the first stage's forwards are followed by other chunks' work
    assert last["kept_on_device"][0] > 0  # the last stage turns its last chunk around


def second_look_job(rank: int, world_size: int, native: str, look: str = "1") -> dict[str, Any]:
    """Worker: PP=2 x VPP=2, 8 microbatches, attn_norm (which saves each layer's input) offloaded or not."""
    import os

    os.environ["MCORE_OFFLOAD_NATIVE"] = native  # before this process makes its manager
    os.environ["MCORE_OFFLOAD_SECOND_LOOK"] = look
    from mcore_offload.runtime import native as native_module

    init_parallel(world_size, rank, pp=2, vpp=2)
    kw = dict(n_steps=2, num_microbatches=8, seq_len=16, micro_batch_size=2, lr=0.1)
    base = run_steps(build_dense_gpt(num_layers=8), **kw)
    result = run_steps(build_dense_gpt(num_layers=8, config_overrides=offload("attn_norm")), **kw)
    counters = ("offloaded", "released_in_forward", "reloaded", "reloaded_on_demand", "skipped_aliased")
    return {"base": base, "offload": result, "second_look": get_manager().second_look_bytes,
            "native": native_module.load_native() is not None,
            **{c: [s.total(c) for s in get_summary().steps[-2:]] for c in counters}}


@pytest.mark.multiproc
@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp-copy-out", "python-copy-out"])
def test_a_chunks_first_input_leaves_the_device_once_its_forward_has_returned(native):
    """The first layer's input (the embedding output on the first stage) is still held by GPTModel.forward when
    the layers flush; once that forward returns, a second look copies it out before the chunk's backward. The
    input the schedule keeps (received from the previous stage) stays where it is."""
    ranks = run_multiprocess(second_look_job, 2, args=(native,), timeout_s=240)
    layer_input = 2 * 16 * 32 * 4  # micro batch 2, sequence 16, hidden 32, float32
    for rank, r in enumerate(ranks):
        assert r["native"] is (native == "1")
        assert_bitwise(r["base"], r["offload"])
        assert r["offloaded"] == r["released_in_forward"] == r["reloaded"], r
        assert r["reloaded_on_demand"] == [0, 0]
        # every chunk's first input is held at flush time; the schedule keeps the received ones for good
        received = 8 * (1 if rank == 0 else 2) * layer_input  # rank 0's chunk 0 input is its embedding output
        assert r["skipped_aliased"] == [received] * 2, r["skipped_aliased"]
    first, last = ranks
    assert first["second_look"] == 2 * 8 * layer_input  # the embedding outputs of 8 microbatches a step
    assert last["second_look"] == 0


@pytest.mark.multiproc
def test_without_the_second_look_the_held_inputs_stay():
    """MCORE_OFFLOAD_SECOND_LOOK=0: the first stage's embedding outputs stay on the device until their backward,
    counted as skipped with the received inputs, and nothing else changes (bitwise)."""
    ranks = run_multiprocess(second_look_job, 2, args=("1", "0"), timeout_s=240)
    layer_input = 2 * 16 * 32 * 4
    for r in ranks:
        assert_bitwise(r["base"], r["offload"])
        assert r["second_look"] == 0
        assert r["skipped_aliased"] == [8 * 2 * layer_input] * 2, r["skipped_aliased"]  # both chunks' inputs
        assert r["offloaded"] == r["released_in_forward"] == r["reloaded"], r
