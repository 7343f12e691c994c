"""What ``pretrain_gpt.py`` records about a run besides its timings: the software versions, the allocator's peak
reader, and upstream 0.16's own count of the bytes it offloaded.

Benchmark tooling only: the library never imports this module.
"""

from __future__ import annotations

import sys

import torch


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
