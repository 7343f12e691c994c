"""benchmarks/trace_step_ops.py: self CPU time per op, offloaded steps against plain ones, from a synthetic trace."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_step_ops as tso  # noqa: E402


def ev(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "cat": cat}


def trace() -> dict:
    evs = []
    for n, on in ((10, True), (11, False)):
        t0 = n * 1000.0
        evs.append(ev(f"bench step {n} {'on' if on else 'off'}", t0, 900, cat="user_annotation"))
        # a forward op with a nested launch, the same in both steps
        evs.append(ev("aten::linear", t0 + 10, 100))
        evs.append(ev("cudaLaunchKernel", t0 + 20, 30, cat="cuda_runtime"))
        # backward on the autograd thread: slower when offloaded
        evs.append(ev("autograd::engine::evaluate_function: MmBackward0", t0 + 200, 300 if on else 200, tid=2))
        if on:
            evs.append(ev("cudaMemcpyAsync", t0 + 220, 50, tid=2, cat="cuda_runtime"))
    evs.append(ev("aten::linear", 5000, 100))  # outside every step: not counted
    evs.append({"ph": "X", "name": "kernel", "ts": 10050, "dur": 10, "pid": 1, "tid": 7, "cat": "kernel"})
    return {"traceEvents": evs}


def test_self_time_subtracts_nested_events() -> None:
    out = tso.self_stats([ev("a", 0, 100), ev("b", 10, 30), ev("c", 50, 20), ev("d", 200, 5)])
    assert {name: us for name, (us, _) in out.items()} == {"a": 50, "b": 30, "c": 20, "d": 5}


def test_compare_charges_each_name_its_own_change(tmp_path: Path) -> None:
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace(), f)
    steps = tso.step_ops(tso.load_trace(str(path)))
    assert {n: on for n, (on, *_) in steps.items()} == {10: True, 11: False}
    rows = {r["name"]: r for r in tso.compare(steps)}
    assert rows["aten::linear"]["delta_ms"] == pytest.approx(0.0)  # the op outside the steps is not counted
    assert rows["aten::linear"]["on_ms"] == pytest.approx(0.070)  # 100 less its 30 µs launch
    assert rows["autograd::engine::evaluate_function: MmBackward0"]["delta_ms"] == pytest.approx(0.050)
    assert rows["cudaMemcpyAsync"]["delta_ms"] == pytest.approx(0.050)
    # the backward op ran once in each step and took longer: slower, not more calls; the copy is an extra call
    mm = rows["autograd::engine::evaluate_function: MmBackward0"]
    assert (mm["on_calls"], mm["off_calls"]) == (1, 1)
    assert mm["slower_ms"] == pytest.approx(0.050) and mm["extra_calls_ms"] == pytest.approx(0.0)
    assert rows["cudaMemcpyAsync"]["extra_calls_ms"] == pytest.approx(0.050)
    assert rows["cudaMemcpyAsync"]["slower_ms"] == pytest.approx(0.0)
    assert "kernel" not in rows  # GPU events are not host time
    # --skip leaves out the first profiled steps (the profiler's start slows the first)
    assert list(tso.step_ops(tso.load_trace(str(path)), skip=1)) == [11]
    assert [n for n, *_ in tso.step_ranges(tso.load_trace(str(path)))] == [10, 11]


def test_self_stats_counts_calls() -> None:
    out = tso.self_stats([ev("a", 0, 100), ev("b", 10, 30), ev("b", 50, 20)])
    assert out["a"] == [50, 1] and out["b"] == [50, 2]


def test_paired_delta_reads_each_offloaded_step_against_its_neighbours() -> None:
    # the host slows late in the run (the last plain step 400 µs): the means differ by 25 µs, but every offloaded
    # step is 50 µs over the mean of the plain steps beside it
    evs, t0 = [], 0.0
    for n, us in enumerate((100, 150, 100, 300, 400)):
        on = n % 2 == 1
        evs.append(ev(f"bench step {n} {'on' if on else 'off'}", t0, 1000, cat="user_annotation"))
        evs.append(ev("op", t0 + 1, us))
        t0 += 2000
    rows = {r["name"]: r for r in tso.compare(tso.step_ops({"traceEvents": evs}))}
    assert rows["op"]["delta_ms"] == pytest.approx(0.025)
    assert rows["op"]["paired_median_ms"] == pytest.approx(0.050)
    assert rows["op"]["paired_positive"] == "2/2"


def test_one_sided_trace_is_refused() -> None:
    only_on = {"traceEvents": [ev("bench step 3 on", 0, 100, cat="user_annotation"), ev("x", 10, 5)]}
    with pytest.raises(SystemExit, match="offloaded and plain steps"):
        tso.compare(tso.step_ops(only_on))


@pytest.mark.multiproc
def test_pretrain_gpt_profile_marks_each_step_on_or_off(tmp_path: Path) -> None:
    from test_benchmarks import tiny_run

    prof = tmp_path / "prof"
    tiny_run(tmp_path / "run.json", 29641, ["--train-iters", "4", "--warmup-steps", "1",
                                            "--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                                            "--alternate-offload", "--profile-steps", "1", "2",
                                            "--profile-dir", str(prof)])
    steps = tso.step_ops(tso.load_trace(str(prof / "trace_rank0.json.gz")))
    assert {n: on for n, (on, *_) in steps.items()} == {1: False, 2: True}
    assert tso.main([str(prof / "trace_rank0.json.gz"), "--skip", "0", "--json-out", str(tmp_path / "o.json")]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["left_out"] == []
    rows = {r["name"]: r for r in tso.compare(steps)}
    assert rows  # CPU ops were charged to the two steps
    assert any(r["on_ms"] > 0 for r in rows.values()) and any(r["off_ms"] > 0 for r in rows.values())
