"""The profiling tools of benchmarks/: trace_analysis.py (torch.profiler traces), sync_wait.py (host reads that
wait for the GPU) and peak_trace.py (what was live at the peak)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_trace_analysis_splits_compute_idle_into_cpu_bound_and_gpu_wait():
    import trace_analysis

    def kernel(ts, dur, corr, stream=7):
        return {"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": ts, "dur": dur,
                "args": {"stream": stream, "correlation": corr}}

    def launch(ts, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5,
                "args": {"correlation": corr}}

    events = [
        kernel(0, 100, 1), launch(-20, 1),
        kernel(200, 100, 2), launch(10, 2),     # launched early: the 100 us gap is a GPU-side wait
        kernel(400, 100, 3), launch(345, 3),    # launched 50 us after the stream went idle at 300
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 0, "dur": 1000,
         "args": {"stream": 20, "bytes": 55_000_000}},
        {"ph": "X", "cat": "user_annotation", "name": "mcore_offload.x", "ts": 0, "dur": 2000},
    ]
    out = trace_analysis.analyse({"traceEvents": events})
    cs = out["compute_stream"]
    assert cs["stream"] == "7" and cs["busy_ms"] == pytest.approx(0.3) and cs["window_ms"] == pytest.approx(0.5)
    assert cs["cpu_bound_ms"] == pytest.approx(0.05) and cs["gpu_wait_ms"] == pytest.approx(0.15)
    assert out["copies"]["DtoH"]["GBps"] == pytest.approx(55.0)
    assert out["annotations"]["mcore_offload.x"] == {"count": 1, "ms": 2.0}


def test_trace_analysis_compute_stream_is_not_a_waiting_nccl_stream():
    """Under pipeline parallelism one NCCL receive can spin longer than all of a rank's compute: the compute stream
    is the stream with the most kernels, NCCL's not counted."""
    import trace_analysis

    events = [{"ph": "X", "cat": "kernel", "name": f"gemm{i}", "ts": i * 100, "dur": 50,
               "args": {"stream": 7, "correlation": i}} for i in range(5)]
    events += [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                "ts": i * 1000, "dur": 900, "args": {"stream": 30, "correlation": 100 + i}} for i in range(2)]
    cs = trace_analysis.analyse({"traceEvents": events})["compute_stream"]
    assert cs["stream"] == "7" and cs["busy_ms"] == pytest.approx(0.25)


def test_sync_wait_times_only_recorded_calls_and_restores_the_methods(monkeypatch):
    """--time-syncs: host time and calls inside the wrapped methods, per recorded step; uninstall leaves the
    classes as they were (``torch.Tensor.cpu`` is inherited, so it is deleted again, not overwritten)."""
    import time

    import sync_wait
    import torch

    class Device:
        def synchronize(self) -> None:
            time.sleep(0.003)

    original = Device.synchronize
    monkeypatch.setattr(sync_wait, "TARGETS", ((Device, "synchronize", False), (torch.Tensor, "cpu", True)))
    syncs = sync_wait.SyncWait()
    syncs.install()
    try:
        Device().synchronize()  # not recording: not counted
        for flag in (True, False):
            syncs.start_step()
            Device().synchronize()
            if flag:
                Device().synchronize()
            torch.ones(2).cpu()  # a CPU tensor: never counted
            syncs.end_step()
    finally:
        syncs.uninstall()
    assert Device.synchronize is original and "cpu" not in torch.Tensor.__dict__
    out = syncs.as_dict([True, False], 0)
    assert out["calls_per_step"] == [2, 1]
    assert out["per_step_ms"][0] >= 6 and 3 <= out["per_step_ms"][1] < out["per_step_ms"][0]
    assert out["on_median_ms"] == pytest.approx(out["per_step_ms"][0], abs=1e-3)
    assert out["off_median_ms"] == pytest.approx(out["per_step_ms"][1], abs=1e-3)
    assert set(out["total_ms_by_call"]) == {"Device.synchronize"}


def test_peak_trace_finds_the_peak_and_the_reloaded_bytes_live_then():
    """The replay starts from the bytes allocated before the trace, honours delayed frees (free_completed), and
    counts live reload allocations by their source file."""
    from peak_trace import analyse

    ours = [{"filename": "/x/mcore_offload/runtime/transport.py", "line": 520, "name": "to_device"}]
    model = [{"filename": "/y/site-packages/megatron/core/transformer/mlp.py", "line": 10, "name": "forward"}]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 50, "frames": model},
        {"action": "free_requested", "addr": 2, "size": 50, "frames": model},  # still counted until completed
        {"action": "alloc", "addr": 3, "size": 30, "frames": model},  # the peak: 1000 + 100 + 50 + 30
        {"action": "free_completed", "addr": 2, "size": 50, "frames": model},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": ours},
        {"action": "alloc", "addr": 4, "size": 120, "frames": model},  # 1000 + 30 + 120: below the peak
    ]
    r = analyse(events, base=1000)
    assert r["peak_bytes"] == 1180 and r["peak_event_index"] == 3 and r["peak_alloc_bytes"] == 30
    assert r["live_reload_bytes"] == {"ours_reload": 100, "native_reload": 0}
    assert r["peak_alloc_where"] == ["megatron/core/transformer/mlp.py:10 forward"]
    # live at the peak, by size and call path without line numbers (two megatron versions compare)
    assert r["live_step_bytes"] == 180
    assert r["live_by_site"] == [{"size": 100, "count": 1, "bytes": 100, "where": "transport.py:to_device"},
                                 {"size": 50, "count": 1, "bytes": 50, "where": "mlp.py:forward"},
                                 {"size": 30, "count": 1, "bytes": 30, "where": "mlp.py:forward"}]
    assert analyse([], base=7)["peak_bytes"] == 7


def test_peak_trace_census_groups_the_allocated_blocks_of_one_device():
    """census(): only active blocks of the asked device count; blocks from before recording have no call path."""
    from peak_trace import census

    weights = [{"filename": "/y/site-packages/megatron/core/tensor_parallel/layers.py", "line": 1, "name": "__init__"}]
    segments = [
        {"device": 0, "blocks": [{"size": 64, "state": "active_allocated", "frames": weights},
                                 {"size": 64, "state": "active_allocated", "frames": weights},
                                 {"size": 32, "state": "inactive"},  # cached, free: not allocated
                                 {"size": 16, "state": "active_allocated"}]},  # before recording began
        {"device": 1, "blocks": [{"size": 999, "state": "active_allocated", "frames": weights}]},
    ]
    c = census(segments, device=0)
    assert c["allocated_bytes"] == 144 and c["blocks"] == 3
    assert c["by_site"] == [{"size": 64, "count": 2, "bytes": 128, "where": "layers.py:__init__"},
                            {"size": 16, "count": 1, "bytes": 16, "where": ""}]
