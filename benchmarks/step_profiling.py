"""What a benchmark step costs besides its own work: torch.profiler traces, cProfile, garbage-collector time.

Helpers of ``pretrain_gpt.py`` (``--profile-steps``, ``--cprofile-steps`` and the per-step ``gc_ms`` of every run).
"""

from __future__ import annotations

import gc
import json
import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger("pretrain_gpt")


def annotate_offload_runtime() -> None:
    """Name the offload runtime's own work in profiler traces (profiling runs only)."""
    try:
        from mcore_offload.runtime import handler, transport
    except ImportError:
        return
    targets = [(handler.ChunkOffloadHandler, n) for n in
               ("tensor_push", "tensor_pop", "flush", "on_group_commit_backward", "on_group_backward_done",
                "finish")] + [(transport.CudaTransport, n) for n in ("to_host", "to_device")]
    for cls, name in targets:
        fn = getattr(cls, name)

        def wrapped(*a, __fn=fn, __label=f"mcore_offload.{cls.__name__}.{name}", **kw):
            with torch.profiler.record_function(__label):
                return __fn(*a, **kw)

        setattr(cls, name, wrapped)


def write_profile(prof, args, rank: int) -> None:
    import gzip
    import shutil

    from trace_analysis import analyse

    out = Path(args.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / f"trace_rank{rank}.json"
    prof.export_chrome_trace(str(trace))
    summary = analyse(json.loads(trace.read_text()))
    (out / f"analysis_rank{rank}.json").write_text(json.dumps(summary, indent=1))
    (out / f"ops_rank{rank}.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    cs = summary.get("compute_stream", {})
    logger.info("rank %d profile: compute stream busy %.1f of %.1f ms, idle cpu-bound %.1f ms, gpu-wait %.1f ms",
                rank, cs.get("busy_ms", 0), cs.get("window_ms", 0), cs.get("cpu_bound_ms", 0),
                cs.get("gpu_wait_ms", 0))


def start_cprofile():
    import cProfile

    # The autograd engine runs CUDA backward on its own thread, which cProfile would not see.
    torch.autograd.set_multithreading_enabled(False)
    prof = cProfile.Profile()
    prof.enable()
    return prof


def stop_cprofile(prof, args, rank: int) -> None:
    import io
    import pstats

    prof.disable()
    torch.autograd.set_multithreading_enabled(True)
    out = Path(args.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(60)
    stats.sort_stats("cumulative").print_stats("mcore_offload", 40)
    (out / f"cprofile_rank{rank}.txt").write_text(buf.getvalue())
    stats.dump_stats(str(out / f"cprofile_rank{rank}.pstats"))


class GcClock:
    """Time spent in Python's garbage collector per step (``gc.callbacks``), and collections per generation."""

    def __init__(self) -> None:
        self.per_step: list[float] = []
        self.collections = [0, 0, 0]
        self._t0 = 0.0
        self._acc = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self._acc += time.perf_counter() - self._t0
            self.collections[info["generation"]] += 1

    def start_step(self) -> None:
        self._acc = 0.0

    def end_step(self) -> None:
        self.per_step.append(round(self._acc * 1e3, 3))
