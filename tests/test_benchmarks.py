"""The benchmark scripts: a tiny CPU run end to end (gloo, local spec), and the report arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import peak_memory  # noqa: E402


def differs_only_before_step_2(a: list, b: list) -> bool:
    """Whether two runs' losses differ in steps 0-1 only, with at least one later step, all bitwise equal.

    Rarely (about once in ten suite runs in earlier sessions, in plain baselines too, always the same alternative step-0
    value) a process's first two CPU losses differ in their last bits from another process's, while every later
    loss agrees. Offloading cannot cause that: a step's loss is computed in forward, before anything saved for
    backward is read back, and a wrong step-0 gradient would move the weights and every later loss. Such a pair is
    run again once, and the second pair must agree in every step.
    """
    return len(a) == len(b) > 2 and a[2:] == b[2:] and a[:2] != b[:2]


def tiny_pair(tmp_path, port: int, common: list[str], first: list[str], second: list[str]) -> tuple[dict, dict]:
    """``pretrain_gpt.py`` on the tiny CPU model through torchrun, with ``first`` then ``second`` extra flags: rank
    0's rows (run again once if their losses differ in steps 0-1 only: :func:`differs_only_before_step_2`)."""
    for attempt in range(2):
        rows = [tiny_run(tmp_path / f"run{attempt}-{i}.json", port, [*common, *extra])
                for i, extra in enumerate((first, second))]
        if not differs_only_before_step_2(rows[0]["loss_hex"], rows[1]["loss_hex"]):
            break
    return rows[0], rows[1]


def tiny_run(js, port: int, flags: list[str]) -> dict:
    """One ``pretrain_gpt.py`` run on the tiny CPU model through torchrun: rank 0's row."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(port),
         str(ROOT / "benchmarks" / "cpu_launch.py"), *peak_memory.TINY.split(), *flags, "--json-out", str(js)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(js.read_text())["ranks"][0]


def tiny_base_and_ours(tmp_path, port: int, common: list[str], ours: list[str]) -> tuple[dict, dict]:
    """:func:`tiny_pair` without offloading, then with ``--offload-modules`` ``ours``."""
    return tiny_pair(tmp_path, port, common, [], ["--fine-grained-activation-offloading", "--offload-modules", *ours])


def issue5_summary(tmp_path, stem: str, row: dict) -> str:
    """What issue5_host.sh's summary (its Python, run here) prints for one run's rank-0 ``row`` saved as ``stem``."""
    script = (ROOT / "benchmarks" / "gpu" / "issue5_host.sh").read_text()
    summary = script.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    runs = tmp_path / "runs"
    runs.mkdir(exist_ok=True)
    (runs / f"{stem}.json").write_text(json.dumps({"args": {}, "ranks": [row]}))
    proc = subprocess.run([sys.executable, "-", str(runs)], input=summary, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_only_a_difference_confined_to_the_first_two_steps_is_run_again():
    assert differs_only_before_step_2(["a", "x", "c", "d"], ["b", "x", "c", "d"])
    assert differs_only_before_step_2(["a", "x", "c"], ["b", "y", "c"])
    assert not differs_only_before_step_2(["a", "x", "c"], ["a", "x", "c"])  # equal: nothing to rerun
    assert not differs_only_before_step_2(["a", "x", "c"], ["b", "x", "d"])  # a later step differs: a real failure
    assert not differs_only_before_step_2(["a", "x"], ["b", "x"])  # no later step to vouch for the gradients
    assert not differs_only_before_step_2(["a", "x", "c"], ["a", "x", "c", "d"])


@pytest.mark.multiproc
def test_peak_memory_smoke_on_cpu(tmp_path):
    """baseline + ours on the tiny dense model: every run finishes, losses equal, bytes offloaded."""
    for attempt in range(2):  # again once if a run's losses differ in steps 0-1 only (differs_only_before_step_2)
        out = tmp_path / f"pm{attempt}"
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peak_memory.py"), "--config", "tiny-dense",
                               "--impls", "baseline", "ours", "--train-iters", "4", "--warmup-steps", "2",
                               "--out", str(out), "--extra=--audit-offloaded"],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = json.loads((out / "results.json").read_text())["rows"]
        losses = [json.loads((out / f"{r['run']}.json").read_text())["ranks"][0]["loss_hex"] for r in rows]
        if not any(differs_only_before_step_2(losses[0], other) for other in losses[1:]):
            break
    assert [(r["impl"], r["offload_modules"]) for r in rows] == [
        ("baseline", []), ("ours", ["core_attn"]), ("ours", ["qkv_linear", "core_attn", "attn_proj"]),
        ("ours", ["auto"])]
    assert all(r["loss_equal"] for r in rows)
    assert all(r["timed_steps"] == 2 and r["step_ms_median"] > 0 for r in rows)
    assert set(rows[1]["offloaded_bytes_by_point"]) == {"core_attn"} and rows[1]["offloaded_bytes_by_point"][
        "core_attn"] > 0
    assert rows[2]["offloaded_bytes_by_point"]["qkv_linear"] > 0
    assert rows[3]["offloaded_bytes_by_point"]["core_attn"] > 0  # auto's planned step (after its probe)
    assert all(r["runtime_cpu_ms"] > 0 for r in rows[1:])  # host time in the hooks, per step
    for r in rows[1:]:  # --audit-offloaded: bytes were judged and none was a parameter or main_grad
        assert r["audit"]["offloaded_bytes"] > 0 and not any(r["audit"]["overlap_bytes"].values())
    assert rows[0]["audit"] is None and all(r["offload_steps"] == 4 for r in rows[1:])
    assert "| tiny-dense | ours |" in (out / "results.md").read_text()


def _result(peaks, step_ms, losses, host=None):
    return {"ranks": [{"rank": i, "peak_bytes": p, "step_ms_median": step_ms, "timed_steps": 8,
                       "loss_hex": losses if i == len(peaks) - 1 else [None] * len(losses),
                       "host_bytes_at_peak": host, "versions": {"megatron_core": "0.15.3"}}
                      for i, p in enumerate(peaks)]}


def test_rows_compare_each_run_with_its_own_trees_baseline(tmp_path):
    base = peak_memory.Run("A", "baseline", "/mc15")
    base.result = _result([1000, 800], 100.0, ["0x1p+0", "0x1p-1"])
    ours = peak_memory.Run("A", "ours", "/mc15", ["core_attn"])
    ours.result = _result([900, 750], 103.0, ["0x1p+0", "0x1p-1"], host=100)
    other = peak_memory.Run("A", "baseline", "/mc16")  # another tree: never the reference of ours
    other.result = _result([5000, 5000], 50.0, ["0x1p+1", "0x1p-1"])
    native = peak_memory.Run("A", "native", "/mc16", ["core_attn"])
    native.result = _result([4900, 4950], 60.0, ["0x1p+1", "0x1p-2"], host=200)
    rows = peak_memory.rows_for([base, ours, other, native], {"gpu": "test"})
    r0, r1 = rows[2], rows[3]
    assert (r0["delta_peak_bytes"], r0["R"]) == (100, 1.0)
    assert (r1["delta_peak_bytes"], r1["R"]) == (50, 0.5)
    assert r0["overhead_pct"] == pytest.approx(3.0) and r0["loss_equal"] is True
    n0 = rows[6]
    assert (n0["delta_peak_bytes"], n0["overhead_pct"], n0["loss_equal"]) == (100, pytest.approx(20.0), False)
    table = peak_memory.markdown(rows)
    assert "| A | ours | 0.15.3 | core_attn | 0 |" in table
    if peak_memory.plot(rows, tmp_path / "p.png"):
        assert (tmp_path / "p.png").stat().st_size > 0


def test_bad_arguments_get_one_sentence(capsys):
    with pytest.raises(SystemExit):
        peak_memory.parse_args(["--config", "A", "--impls", "native", "--out", "x"])
    assert "needs --native-megatron" in capsys.readouterr().err
    args = peak_memory.parse_args(["--config", "tiny-dense", "--impls", "native", "--native-megatron", "/x",
                                   "--out", "x"])
    with pytest.raises(SystemExit, match="cannot run; drop native"):
        peak_memory.plan_runs(args)


def test_matrix_summary_lists_each_set_once_with_per_rank_values():
    import report_matrix

    base = {"config": "D", "impl": "baseline", "offload_modules": [], "megatron_core": "0.15.3"}
    rows = [dict(base, rank=0), dict(base, rank=1)]
    for rank, delta, r, over in ((1, 50 * 2**20, 1.0, 3.0), (0, 100 * 2**20, 0.5, 2.0)):
        rows.append({"config": "D", "impl": "ours", "offload_modules": ["core_attn"], "rank": rank,
                     "delta_peak_bytes": delta, "R": r, "overhead_pct": over, "loss_equal": True})
    text = report_matrix.summary(rows)
    assert "| D | core_attn | ours | 100 / 50 | 0.50 / 1.00 | +2.0 / +3.0 | True |" in text
    assert "baseline" not in text


def test_cpu_transport_glue_times_both_bursts_on_the_stub_runtime(tmp_path):
    """The stub CUDA runtime answers every call the raw transport makes: both bursts run and are timed."""
    import shutil

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler for the stub runtime")
    import cpu_transport_glue

    out = tmp_path / "glue.json"
    assert cpu_transport_glue.main(["--calls", "20", "--storages", "3", "--json-out", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row["storages"] == 3 and set(row["us_per_burst"]) == {
        "to_host (C++ copy loop)", "to_device (Python allocations)", "one ctypes call"}
    assert all(v > 0 for v in row["us_per_burst"].values())


@pytest.mark.multiproc
def test_pretrain_gpt_evaluation_between_steps_offloads_nothing(tmp_path):
    """--eval-interval 1: a forward-only evaluation after every step; training still offloads and matches."""
    common = ["--train-iters", "3", "--eval-interval", "1", "--eval-iters", "2"]
    base, ours = tiny_base_and_ours(tmp_path, 29631, common, ["qkv_linear", "core_attn", "attn_proj"])
    out = {"base": base, "ours": ours}
    assert out["ours"]["loss_hex"] == out["base"]["loss_hex"]
    assert len(out["ours"]["eval_losses"]) == 3 and out["ours"]["eval_losses"] == out["base"]["eval_losses"]
    offload = out["ours"]["offload"]
    assert offload["steps"] == 3  # one record per training step; evaluations left no activity
    assert offload["host_resident_bytes"] == 0 and offload["last_step"]["core_attn"]["offloaded"] > 0
    clock = ours["host_clock"]  # one value per step in every per-step list (benchmarks/host_clock.py)
    assert {len(v) for v in clock.values()} == {3} and all(t > 0 for t in clock["thread_cpu_ms"])
    assert ours["pid"] > 0 and clock["start_monotonic"] == sorted(clock["start_monotonic"])  # perf_steps.py's keys


def test_repeats_interleave_and_merge_into_the_median_of_medians():
    args = peak_memory.parse_args(["--config", "tiny-dense", "--sets", "core_attn", "--repeat", "3", "--out", "/x"])
    runs = peak_memory.plan_runs(args)
    assert [(r.impl, r.rep) for r in runs] == [("baseline", 0), ("ours", 0), ("baseline", 1), ("ours", 1),
                                               ("baseline", 2), ("ours", 2)]
    for r, ms in zip(runs, [10, 20, 30, 11, 12, 13]):
        r.result = {"ranks": [{"rank": 0, "step_ms_median": ms, "loss_hex": ["a"]}]}
    runs[5].result["ranks"][0]["loss_hex"] = ["b"]  # one repetition of ours computed something else
    base, ours = peak_memory.merge_repeats(runs)
    b = base.result["ranks"][0]
    assert b["step_ms_medians"] == [10, 30, 12] and b["step_ms_median"] == 12
    assert ours.result["ranks"][0]["step_ms_median"] == 13 and ours.result["ranks"][0]["loss_hex"] == [None]


def test_cpu_bind_parses_sysfs_cpu_lists_and_refuses_too_few_cores(monkeypatch):
    import cpu_affinity

    assert cpu_affinity.parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert cpu_affinity.bind("none", 0, 4) == sorted(os.sched_getaffinity(0))
    monkeypatch.setattr(cpu_affinity, "gpu_local_cpus", lambda index: [0, 1])
    with pytest.raises(ValueError, match=r"needs 4 cores per rank, but the GPU's node has 2; lower --cpu-bind-cores"):
        cpu_affinity.bind("compact", 0, 4)


@pytest.mark.multiproc
def test_pretrain_gpt_runtime_breakdown_times_the_runtime_without_changing_the_loss(tmp_path):
    """--runtime-breakdown wraps the runtime's functions: every row counted, loss still the baseline's."""
    base, ours = tiny_base_and_ours(tmp_path, 29632, ["--train-iters", "3", "--warmup-steps", "1"],
                                    ["core_attn", "--runtime-breakdown"])
    out = {"base": base, "ours": ours}
    assert out["ours"]["loss_hex"] == out["base"]["loss_hex"]
    bd = out["ours"]["runtime_breakdown"]
    assert bd["steps"] == 2 and bd["wrapper_us"] > 0 and bd["native_points"] is False  # the Python glue, timed
    rows = bd["functions"]
    # one group per core_attn point: as many commits forward as backward, each timed
    assert rows["GroupCommit.apply"]["calls_per_step"] == rows["GroupCommit.backward"]["calls_per_step"] > 0
    assert rows["ChunkOffloadHandler.flush"]["us_per_step"] >= rows["Transport.to_host"]["us_per_step"] > 0
    assert "runtime_breakdown" not in out["base"]


def test_cpu_grouped_layer_measures_an_offloading_step(tmp_path):
    out = tmp_path / "grouped.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_grouped_layer.py"), "--pairs", "4",
                           "--layers", "2", "--experts", "4", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["pairs"] == 4 and isinstance(result["added_us_per_layer_microbatch"], float)
    assert result["transport"] == "Transport"  # the CPU's synchronous copies
    # --paused: the same steps inside mcore_offload.paused() (the script fails if one of them offloaded)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_grouped_layer.py"), "--pairs", "4",
                           "--layers", "2", "--pattern", "attention", "--paused", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["paused"] is True and "(paused)" in proc.stderr
    # --hooks-only: every saved tensor under the size floor (the script fails if one of the steps offloaded)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_grouped_layer.py"), "--pairs", "4",
                           "--layers", "2", "--pattern", "attention", "--hooks-only", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["hooks_only"] is True and "(hooks only)" in proc.stderr


def test_cpu_grouped_layer_evict_writes_its_buffer_at_each_layer_in_forward_and_backward(tmp_path):
    """--evict-mib: every layer's forward and backward write the buffer once (the points then find caches as cold as a
    real layer leaves them), the gradient passes unchanged, and the grouped pattern refuses the option."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cpu_grouped_layer import build_pattern, points_config

    model, x, _ = build_pattern("attention", 3, 4)
    model.evict = torch.zeros(16)
    plain, _, _ = build_pattern("attention", 3, 4)
    plain.qkv = model.qkv
    off = points_config(["core_attn"], False)
    model(x, off).sum().backward()
    grad = x.grad.clone()
    x.grad = None
    plain(x, off).sum().backward()
    assert torch.equal(model.evict, torch.full((16,), 6.0)) and torch.equal(x.grad, grad)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_grouped_layer.py"), "--pairs", "2",
                           "--layers", "2", "--evict-mib", "0.5"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "--evict-mib needs --pattern attention" in proc.stderr
    out = tmp_path / "evict.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_grouped_layer.py"), "--pairs", "4",
                           "--layers", "2", "--pattern", "attention", "--hooks-only", "--evict-mib", "0.5",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["evict_mib"] == 0.5 and "0.5 MiB written a layer" in proc.stderr


def test_cpu_points_glue_times_both_glues_in_one_process(tmp_path):
    """cpu_points_glue.py: runs of the C++ and the Python glue alternate; both figures and their paired difference."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cpu_transport_glue

    from mcore_offload.runtime import native

    if cpu_transport_glue.compiler() is None or native.toolchain_missing():
        pytest.skip("no C compiler for the stub CUDA runtime, or the C++ runtime cannot be built here")
    out = tmp_path / "glue.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_points_glue.py"), "--reps", "3",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["glue"]) == {"C++", "Python"} and result["reps"] == 3
    assert all(r["fastest_us"] > 0 for r in result["glue"].values()) and "Python less C++" in proc.stdout


def _need_stub_compiler() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cpu_transport_glue

    if cpu_transport_glue.compiler() is None:
        pytest.skip("no C compiler for the stub CUDA runtime")


def test_cpu_grouped_layer_with_the_stub_cuda_transport_runs_the_raw_transport(tmp_path):
    """--stub-cuda: the raw (GPU) transport over the stub CUDA runtime does the offloading step's copies."""
    _need_stub_compiler()
    out = tmp_path / "stub.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_grouped_layer.py"), "--pairs", "4",
                           "--layers", "2", "--pattern", "attention", "--stub-cuda", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["stub_cuda"] is True and "stub CUDA transport" in proc.stderr
    assert result["transport"] == "RawCudaTransport"


def _stub_dma_load(fwd: int, bwd: int) -> tuple[torch.nn.Module, Any, list[tuple[int, int]]]:
    """A chunk of three ``TransformerLayer``s and a DmaLoad with only its hook logic (no CUDA here): its copies are
    recorded as ``(nbytes, kind)`` instead of made."""
    from dma_load import DmaLoad

    class TransformerLayer(torch.nn.Linear):  # the hooks find layers by this class name
        pass

    chunk = torch.nn.Sequential(*(TransformerLayer(4, 4) for _ in range(3)))
    load = object.__new__(DmaLoad)
    super(DmaLoad, load).__init__()
    load.fwd_bytes, load.bwd_bytes = fwd, bwd
    load.fwd, load.bwd = fwd, bwd
    copies: list[tuple[int, int]] = []
    load._copy = lambda nbytes, stream, dst, src, kind: copies.append((nbytes, kind))
    load.d2h = load.h2d = None
    load.src = load.dst = torch.zeros(1)
    load.hosts = [torch.zeros(1), torch.zeros(1)]
    return chunk, load, copies


def test_dma_load_copies_at_every_layer_but_each_chunks_last_in_active_steps_only():
    """DmaLoad's hooks (CPU: its copy recorded instead of made): one copy out per layer's forward and one in per
    layer's backward, each chunk's last layer left out, nothing while inactive."""
    chunk, load, copies = _stub_dma_load(10, 20)
    assert load.install([chunk]) == 2
    for active in (False, True):
        load.active = active
        chunk(torch.randn(2, 4, requires_grad=True)).sum().backward()
    from mcore_offload.runtime.cudart import DEVICE_TO_HOST, HOST_TO_DEVICE

    assert copies == [(10, DEVICE_TO_HOST)] * 2 + [(20, HOST_TO_DEVICE)] * 2
    assert load.calls == {"fwd": 2, "bwd": 2}


def test_dma_load_every_layer_copies_at_each_chunks_last_too():
    """``install(skip_last=False)`` (``--dma-load-every-layer``): a copy each way at all three layers."""
    chunk, load, copies = _stub_dma_load(10, 20)
    assert load.install([chunk], skip_last=False) == 3
    load.active = True
    chunk(torch.randn(2, 4, requires_grad=True)).sum().backward()
    from mcore_offload.runtime.cudart import DEVICE_TO_HOST, HOST_TO_DEVICE

    assert copies == [(10, DEVICE_TO_HOST)] * 3 + [(20, HOST_TO_DEVICE)] * 3
    assert load.calls == {"fwd": 3, "bwd": 3}


def test_cpu_node_hooks_times_both_registrations(tmp_path):
    from mcore_offload.runtime import native

    if native.toolchain_missing():
        pytest.skip(f"the C++ runtime cannot be built here: {native.toolchain_missing()}")
    out = tmp_path / "hooks.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_node_hooks.py"), "--nodes", "4",
                           "--steps", "10", "--json-out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(json.loads(out.read_text())["us_per_hook"]) == {"python", "cpp"}


def test_cpu_pipeline_host_clocks_each_layout_and_counts_each_chunks_forward(tmp_path):
    """cpu_pipeline_host.py: the runtime's clock and breakdown at PP=1 (one process), PP=2 and PP=2 x VPP=2 (two)."""
    _need_stub_compiler()
    out = tmp_path / "pipe.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_pipeline_host.py"), "--layers", "4",
                           "--microbatches", "2", "--warmup", "1", "--steps", "2", "--breakdown",
                           "--layouts", "pp1", "pp2", "pp2vpp2", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    layouts = json.loads(out.read_text())["layouts"]
    assert [len(layouts[k]) for k in ("pp1", "pp2", "pp2vpp2")] == [1, 2, 2]
    for ranks in layouts.values():
        assert all(len(r["runtime_ms"]) == 2 and min(r["runtime_ms"]) > 0 and r["offloaded_bytes"] > 0
                   for r in ranks)
    # a chunk's forward ends once per chunk and microbatch: 1 x 2 at PP=1 and on each rank at PP=2, 2 x 2 at VPP=2
    calls = [ranks[0]["breakdown"]["functions"]["OffloadManager.end_chunk"]["calls_per_step"]
             for ranks in layouts.values()]
    assert calls == [2.0, 2.0, 4.0]
    assert "us a layer-mb" in proc.stderr


def test_cpu_pipeline_host_paired_steps_without_the_pack_hooks_move_nothing(tmp_path):
    """--paired: each offloaded step beside a paused one; --without: the Python glue less a part, nothing moved."""
    _need_stub_compiler()
    out = tmp_path / "paired.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_pipeline_host.py"), "--layers", "4",
                           "--microbatches", "2", "--warmup", "1", "--steps", "2", "--layouts", "pp1", "--paired",
                           "--without", "pack-hooks", "--json-out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["args"]["min_size"] == 2**40 and result["args"]["without"] == ["pack-hooks"]
    (rank0,) = result["layouts"]["pp1"]
    paired = rank0["paired"]
    assert len(paired["on_ms"]) == len(paired["off_ms"]) == len(paired["clock_ms"]) == 2
    assert rank0["offloaded_bytes"] == 0 and min(paired["clock_ms"]) > 0  # the points ran, nothing moved
    assert "added ms" in proc.stderr


def test_cpu_glue_instructions_groups_callgrind_self_counts_by_shared_object():
    import cpu_glue_instructions

    annotate = """--------------------------------------------------------------------------------
1,500 (100.0%)  PROGRAM TOTALS
--------------------------------------------------------------------------------
  700 (46.67%)  /tmp/Python-3.11.7/Objects/dictobject.c:_Py_dict_lookup [/usr/lib/libpython3.11.so.1.0]
  300 (20.00%)  /tmp/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault
  200 (13.33%)  ???:mco::packer_pack(mco::Packer*, _object*) [/c/mcore_offload_hooks_0123456789ab.so]
  100 ( 6.67%)  ???:mco::add_runtime(_object*, long) [/c/mcore_offload_hooks_0123456789ab.so]
  200 (13.33%)  ???:0x0000000004936718
"""
    got = cpu_glue_instructions.by_object(annotate)
    # the build's hash is dropped, so that two builds' counts add up under one name; the totals line is skipped
    assert got == {"libpython3.11.so.1.0": 700, "libpython (inlined)": 300, "mcore_offload_hooks.so": 300, "?": 200}


def test_cpu_runtime_python_counts_the_points_entries_once_per_point_and_layer_microbatch(tmp_path):
    """cpu_runtime_python.py: the runtime's Python functions per layer-microbatch, from cProfile (deterministic)."""
    _need_stub_compiler()
    out = tmp_path / "python.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_runtime_python.py"), "--layout", "pp1",
                           "--layers", "4", "--microbatches", "2", "--steps", "2", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    calls = {r["function"].rsplit(":", 1)[1]: r["calls_per_layer_mb"] for r in result["rows"]}
    # every patched point of a layer enters points.offload and points.commit once per microbatch; the attention set
    # opens one group (one chain) a layer-microbatch
    assert calls["offload"] == calls["commit"] and calls["offload"] >= 3 and calls["open_group"] == 1.0
    assert result["layer_microbatches_a_step"] == 8 and result["calls_per_layer_mb"] > calls["offload"] * 2
    assert "Python calls of mcore_offload a layer-microbatch" in proc.stdout


def test_cpu_attr_counts_sums_per_layer_microbatch_by_type_and_name():
    import cpu_attr_counts

    out = cpu_attr_counts.per_layer_mb({"get A.x": 4, "get A.y": 2, "set B.z": 2}, 2)
    assert (out["total"], out["get"], out["set"]) == (4.0, 3.0, 1.0)
    assert out["by_type"] == [["get A", 3.0], ["set B", 1.0]]
    assert out["by_name"] == [["get A.x", 2.0], ["get A.y", 1.0], ["set B.z", 1.0]]


def test_the_counting_build_of_the_native_runtime_is_cached_under_a_name_of_its_own(monkeypatch):
    from mcore_offload.runtime import native

    monkeypatch.delenv("MCORE_OFFLOAD_NATIVE_COUNT_ATTRS", raising=False)
    plain = native.build_name()
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_COUNT_ATTRS", "1")
    assert native.counting_build() and native.build_name() != plain


def test_callgrind_boundary_sums_the_calls_leaving_one_object_by_caller_and_callee(tmp_path):
    import callgrind_boundary

    # Two of our functions: one calls libpython twice (inclusive 700 and 300) and our own helper (not counted), the
    # helper calls libc (50); a libpython function calling back into ours is not a call leaving ours.
    (tmp_path / "cg.out").write_text(
        "version: 1\ncreator: test\nevents: Ir\n"
        "ob=(1) /tmp/x/mcore_offload_hooks_abc.so\nfl=(1) ???\nfn=(1) mco::outer\n"
        "16 10\n"
        "cob=(2) /usr/lib/libpython3.11.so.1.0\ncfi=(2) ???\ncfn=(2) PyObject_GetAttr\ncalls=3 0\n16 700\n"
        "cob=(2)\ncfi=(2)\ncfn=(2)\ncalls=1 0\n17 300\n"
        "cfn=(3) mco::helper\ncalls=1 0\n18 90\n"
        "fn=(3)\n20 40\n"
        "cob=(3) /lib/libc.so.6\ncfi=(2)\ncfn=(4) memcpy\ncalls=2 0\n21 50\n"
        "ob=(2)\nfl=(2)\nfn=(2)\n5 1000\n"
        "cob=(1)\ncfi=(1)\ncfn=(3)\ncalls=1 0\n6 90\n"
        "totals: 2280\n")
    res = callgrind_boundary.boundary_calls(tmp_path / "cg.out", "mcore_offload_hooks")
    assert res["by_object"] == {"libpython3.11.so.1.0": 1000, "libc.so.6": 50}
    assert res["by_caller"] == {("mco::outer", "libpython3.11.so.1.0"): 1000, ("mco::helper", "libc.so.6"): 50}
    assert res["calls"][("libpython3.11.so.1.0", "PyObject_GetAttr")] == 4
    assert callgrind_boundary.main([str(tmp_path / "cg.out"), "--json-out", str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["total"] == 1050


def test_runtime_clock_share_divides_each_offloaded_steps_clock_by_its_plain_neighbours(tmp_path):
    import runtime_clock_share

    on = [True, False] * 5
    step_ms = [100.0, 90.0, 120.0, 110.0, 130.0, 100.0, 140.0, 120.0, 150.0, 80.0]
    clocks = [1.0, 6.0, 8.0, 11.0, 9.0]  # the offloaded steps' clocks, in order (steps 0, 2, 4, 6, 8)
    # step 0 has no plain step before it; steps 2, 4, 6 and 8 are counted from first=1
    got = runtime_clock_share.clock_shares(step_ms, on, clocks, first=1)
    assert got == [6.0 / 100.0, 8.0 / 105.0, 11.0 / 110.0, 9.0 / 100.0]
    assert runtime_clock_share.clock_shares(step_ms, on, clocks, first=5) == [11.0 / 110.0, 9.0 / 100.0]
    doc = {"args": {"alternate_offload": True, "alternate_period": 2, "warmup_steps": 1},
           "ranks": [{"rank": 0, "step_ms": step_ms, "runtime_cpu_ms": 8.5,
                      "alternation": {"on_steps": on, "step_ms_off_median": 100.0},
                      "offload": {"per_step": {"runtime_cpu_ms": clocks}}}]}
    (tmp_path / "run.json").write_text(json.dumps(doc))
    row = runtime_clock_share.run_share(str(tmp_path / "run.json"), 0)
    assert row["steps"] == 4 and abs(row["share_pct"] - 100 * (8.0 / 105.0 + 9.0 / 100.0) / 2) < 1e-9
    doc["args"]["alternate_period"] = 3
    (tmp_path / "p3.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="period 2"):
        runtime_clock_share.run_share(str(tmp_path / "p3.json"), 0)
