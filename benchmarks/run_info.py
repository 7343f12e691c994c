"""What ``pretrain_gpt.py`` records about a run besides its timings: the software versions, the allocator's peak
reader, upstream 0.16's own count of the bytes it offloaded, and our runtime's summary of the run.

Benchmark tooling only: the library never imports this module.
"""

from __future__ import annotations

import logging
import statistics
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)


def peak_reader(device: torch.device):
    """The allocator's peak-allocated statistic, read without building the flattened stats dict."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_memoryStats(idx)["allocated_bytes"]["all"]["peak"]
        return lambda: torch._C._cuda_memoryStats(idx)["allocated_bytes"]["all"]["peak"]
    except (AttributeError, KeyError, TypeError):
        return lambda: torch.cuda.max_memory_allocated(idx)


def native_accounting() -> dict:
    """Upstream 0.16's own count of offloaded bytes (collected after its warm-up step)."""
    try:
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

        mgr = PipelineOffloadManager.get_instance()
        return {"host_bytes_at_peak": int(mgr.offload_summary_total_bytes),
                "native_offload_bytes_by_point": dict(mgr.offload_summary_bytes),
                "host_bytes_source": "native: PipelineOffloadManager.offload_summary_total_bytes (its own accounting)"}
    except (ImportError, AttributeError) as e:
        return {"host_bytes_at_peak": None, "host_bytes_source": f"native accounting unavailable: {e}"}


def versions() -> dict:
    import megatron.core as mc

    out = {"torch": torch.__version__, "megatron_core": mc.__version__, "python": sys.version.split()[0],
           "cuda": torch.version.cuda}
    try:
        import transformer_engine

        out["transformer_engine"] = transformer_engine.__version__
    except ImportError:
        out["transformer_engine"] = None
    try:
        import mcore_offload

        out["mcore_offload"] = getattr(mcore_offload, "__version__", "unknown")
    except ImportError:
        pass
    return out


def ours_results(args: Any, on_steps: list[bool], switching: bool, at_peak: int | None, breakdown: Any, audit: Any,
                 rank: int) -> dict:
    """Our runtime's part of a rank's row: its summary, the medians of its per-step figures over the counted
    offloading steps, and the breakdown and audit where they ran (both are closed here)."""
    from mcore_offload.summary import get_summary

    summary = get_summary()
    summary.resolve_link(wait=True)  # after the last step: reading its timing events may sync
    row: dict[str, Any] = {"offload": summary.as_dict()}
    per_step = row["offload"]["per_step"]
    # the summary records offloading steps only: skip those of the warm-up (a switching run offloads every step)
    skip = args.warmup_steps if switching else sum(on_steps[:args.warmup_steps])
    if args.offload_first_steps is not None:  # a window's first two offloaded steps are its warm-up
        skip = sum(on_steps[:max(args.warmup_steps, args.offload_from_step + 2)])
    for key in ("stall_ms", "d2h_GBps", "h2d_GBps", "runtime_cpu_ms"):
        vals = [v for v in per_step[key][skip:] if v is not None]
        row[key] = statistics.median(vals) if vals else None
    # the most bytes still being copied out at a chunk's forward end in a counted step: what a higher peak can hold
    trailing = [v for v in per_step.get("trailing_bytes", [])[skip:] if v is not None]
    row["trailing_mib_max"] = max(trailing) / 2**20 if trailing else None
    row["host_bytes_at_peak"] = at_peak
    # auto's inputs and plan, for benchmarks/auto_replay.py (None without auto)
    from mcore_offload.runtime.manager import get_manager

    auto = get_manager().auto
    row["auto_record"] = None if auto is None else auto.record
    if breakdown is not None:
        breakdown.recording = False
        row["runtime_breakdown"] = breakdown.as_dict(max(args.train_iters - args.warmup_steps, 1))
    if audit is not None:
        row["audit"] = audit.as_dict()
        audit.close()
    row["host_bytes_source"] = "ours: offloaded bytes off the device when the step-1 peak was reached"
    logger.info("rank %d\n%s", rank, summary.table(rank))
    return row
