"""A SequentialMLP's experts share one group per layer (``points.expert_loop``); CPU, the tests' MoE GPTModel (local
spec, SequentialMLP experts), through ``get_forward_backward_func()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mcore_offload.runtime import manager as manager_module
from mcore_offload.runtime import points
from mcore_offload.runtime.handler import ChunkOffloadHandler
from mcore_offload.runtime.manager import get_manager, reset
from mcore_offload.runtime.saved import CHAIN_NEXT, Group
from mcore_offload.summary import get_summary
from tests.harness.gpt import RunResult, build_moe_gpt, init_parallel, run_steps

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

STEPS, MICROBATCHES, LAYERS, EXPERTS = 2, 2, 3, 4


@pytest.fixture(scope="module", autouse=True)
def _parallel():
    init_parallel()
    yield


def train(names: list[str]) -> RunResult:
    overrides = (dict(fine_grained_activation_offloading=True, offload_modules=names, min_offloaded_tensor_size=512)
                 if names else None)
    chunks = build_moe_gpt(num_layers=LAYERS, num_experts=EXPERTS, config_overrides=overrides)
    return run_steps(chunks, n_steps=STEPS, num_microbatches=MICROBATCHES, seq_len=16, micro_batch_size=2, lr=0.1)


def counted_train(monkeypatch: pytest.MonkeyPatch, names: list[str], loop: bool, native_points: bool = True
                  ) -> tuple[RunResult, list[Group], dict[str, dict[str, int]]]:
    """``train`` with the expert loop on or off: the result, the groups the last step opened, per-point bytes."""
    monkeypatch.setenv("MCORE_OFFLOAD_EXPERT_LOOP", "1" if loop else "0")
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "1" if native_points else "0")
    reset()
    opened: list[Group] = []
    open_group = ChunkOffloadHandler.open_group

    def recording(self: ChunkOffloadHandler, name: str) -> Group:
        group = open_group(self, name)
        opened.append(group)
        return group

    monkeypatch.setattr(ChunkOffloadHandler, "open_group", recording)
    result = train(names)
    per_step = len(opened) // STEPS
    return result, opened[-per_step:], {p: dict(c) for p, c in get_summary().last_step.points.items()}


def assert_bitwise(a: RunResult, b: RunResult) -> None:
    assert a.losses == b.losses
    for ga, gb in zip(a.grads, b.grads, strict=True):
        assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)


_baseline: dict[str, Any] = {}


def baseline() -> RunResult:
    if "run" not in _baseline:
        reset()
        _baseline["run"] = train([])
    return _baseline["run"]


@pytest.mark.parametrize("names", [["expert_fc1", "moe_act"], ["expert_fc1"], ["moe_act"]],
                         ids=["both", "expert_fc1", "moe_act"])
def test_the_experts_of_a_layer_share_one_group_and_move_the_same_bytes(monkeypatch, names):
    looped, groups_looped, bytes_looped = counted_train(monkeypatch, names, loop=True)
    per_expert, groups_per_expert, bytes_per_expert = counted_train(monkeypatch, names, loop=False)
    for got in (looped, per_expert):
        assert_bitwise(baseline(), got)
    # one group per layer and microbatch, against one per expert (both points on: a chain already joined them)
    assert len(groups_looped) == LAYERS * MICROBATCHES
    assert len(groups_per_expert) == LAYERS * MICROBATCHES * EXPERTS
    assert all(g.points == names for g in groups_looped)  # each point listed once, however many experts joined
    # the same bytes leave and come back, per point
    assert bytes_looped == bytes_per_expert
    for name in names:
        assert bytes_looped[name]["offloaded"] > 0
        assert bytes_looped[name]["reloaded"] == bytes_looped[name]["offloaded"]
        assert bytes_looped[name].get("reloaded_on_demand", 0) == 0  # the reload started at the cat's node
    assert get_summary().host_resident_bytes == 0 and not get_manager().handlers
    assert get_manager().chain_next is CHAIN_NEXT and get_manager().chain is None


def test_the_python_glue_forms_the_same_groups_as_the_native_one(monkeypatch):
    names = ["expert_fc1", "moe_act"]
    native, groups_native, bytes_native = counted_train(monkeypatch, names, loop=True)
    python, groups_python, bytes_python = counted_train(monkeypatch, names, loop=True, native_points=False)
    assert_bitwise(native, python)
    assert [g.points for g in groups_native] == [g.points for g in groups_python]
    assert [len(g.refs) for g in groups_native] == [len(g.refs) for g in groups_python]
    assert bytes_native == bytes_python


def test_a_loop_that_raises_leaves_the_chains_as_they_were(monkeypatch):
    """An expert fails mid-loop: the loop's chain map goes, the step aborts cleanly, and the next steps train bitwise
    equal to a run without offloading."""
    monkeypatch.setenv("MCORE_OFFLOAD_EXPERT_LOOP", "1")
    reset()
    overrides = dict(fine_grained_activation_offloading=True, offload_modules=["expert_fc1", "moe_act"],
                     min_offloaded_tensor_size=512)
    chunks = build_moe_gpt(num_layers=LAYERS, num_experts=EXPERTS, config_overrides=overrides)
    expert = chunks[0].decoder.layers[1].mlp.experts.local_experts[2]
    original = expert.forward

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected fault")

    expert.forward = failing
    kw = dict(num_microbatches=MICROBATCHES, seq_len=16, micro_batch_size=2)
    with pytest.raises(RuntimeError, match="injected fault"):
        run_steps(chunks, n_steps=1, **kw)
    assert get_manager().chain_next is CHAIN_NEXT and not get_manager().handlers
    expert.forward = original
    got = run_steps(chunks, n_steps=STEPS, lr=0.1, **kw)
    ref = run_steps(build_moe_gpt(num_layers=LAYERS, num_experts=EXPERTS), n_steps=STEPS, lr=0.1, **kw)
    assert_bitwise(ref, got)
    assert get_summary().last_step.total("offloaded") > 0


def test_without_offloading_the_loop_hands_the_output_through():
    reset()
    loop = points.expert_loop(object())
    value = torch.ones(2)
    with loop as entered:
        assert entered.commit(value) is value
    assert get_manager().chain_next is CHAIN_NEXT


def test_a_bad_switch_value_is_refused_in_one_sentence(monkeypatch):
    monkeypatch.setenv("MCORE_OFFLOAD_EXPERT_LOOP", "yes")
    with pytest.raises(ValueError, match=r"MCORE_OFFLOAD_EXPERT_LOOP='yes' is not one of 0, 1; unset it"):
        manager_module.OffloadManager()


def test_the_runtime_switch_turns_the_loop_off_and_on_between_steps(monkeypatch):
    """benchmarks/runtime_switch.py (``sw_`` runs): a group per expert against the loop's, in one process."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from runtime_switch import RuntimeSwitch, parse_settings

    monkeypatch.delenv("MCORE_OFFLOAD_EXPERT_LOOP", raising=False)
    reset()
    manager = get_manager()
    assert manager.expert_loop is True  # the default
    switch = RuntimeSwitch(parse_settings(["expert_loop=0"]))
    held = []
    for under_test in (True, False, True):
        switch.start_step(under_test)
        held.append(manager.expert_loop)
        switch.end_step()
    assert held == [False, True, False]
    assert switch.held == [{"expert_loop": "0"}, {"expert_loop": "1"}, {"expert_loop": "0"}]


def _gpu_runs(tarball: Path) -> dict[str, dict]:
    """The JSON of each run in a GPU test's tarball (read in place), by its path there without ``.json``."""
    import json
    import tarfile

    with tarfile.open(tarball) as tar:
        return {m.name.removesuffix(".json"): json.load(tar.extractfile(m))
                for m in tar.getmembers() if m.name.endswith(".json") and "__" in m.name}


def test_the_gpu_runs_on_the_shared_group_repeat_session_81s_numbers_with_less_host_time():
    """Session 82 (1 x H200) ran session 81's three SequentialMLP GPU tests again, the experts sharing one group per
    layer: every loss bitwise equal to session 81's (a group per expert), the same bytes per point to the byte, and
    the runtime's host time a step under two thirds of session 81's with 64 experts (predicted before the lease) and
    lower under FP8 (16 experts)."""
    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    pairs = [(results / "session81-fine-experts" / "fine", results / "session82-expert-loop" / "fine"),
             (results / "session81-fine-experts" / "lease2", results / "session82-expert-loop" / "fp8")]
    compared = 0
    for before_dir, after_dir in pairs:
        before, after = _gpu_runs(before_dir / "results.tgz"), _gpu_runs(after_dir / "results.tgz")
        for run, got in after.items():
            if run not in before:  # lease 2 of session 81 ran one of the two thresholds
                continue
            old, new = before[run]["ranks"][0], got["ranks"][0]
            assert old["loss_hex"] == new["loss_hex"], run
            if "__ours__" in run:
                moved = [{p: c["offloaded"] for p, c in r["offload"]["last_step"].items()} for r in (old, new)]
                assert moved[0] == moved[1] and moved[0]["expert_fc1"] > 0, run
                # predicted for the 64-expert runs; the FP8 run (16 experts) was not predicted: 33 % lower
                bound = 2 / 3 if "fine_grained" in run else 1.0
                assert new["runtime_cpu_ms"] < bound * old["runtime_cpu_ms"], run
                compared += 1
    assert compared == 3
