"""Where does a step's time go? Summarise a torch.profiler Chrome trace of training steps.

- Per CUDA stream: busy time (union of kernel / memcpy / memset intervals).
- The compute stream (the one with the most kernels, NCCL's left out): its idle time inside the profiled window, split
  into gaps where the next kernel was launched late by the CPU ("cpu_bound") and gaps where it had been
  launched in time but the stream waited anyway ("gpu_wait": an event wait, a copy, a synchronisation).
- Copies: bytes and achieved throughput of device-to-host and host-to-device copies.
- CUDA runtime calls that synchronise or allocate (counts and total time).
- CPU time of named ranges (``record_function`` annotations), e.g. the offload runtime's own work.

    python benchmarks/trace_analysis.py trace.json [--top 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_OF_INTEREST = ("Synchronize", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaStreamWaitEvent",
                       "cudaEventRecord", "cudaMemcpyAsync", "cudaEventQuery", "cudaHostRegister")


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _is_nccl(kernel_name: str) -> bool:
    return kernel_name.startswith("nccl")


def analyse(trace: dict, gap_us: float = 20.0, top: int = 15) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    by_stream: dict[int, list[dict]] = defaultdict(list)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    streams = {}
    for sid, evs in by_stream.items():
        streams[str(sid)] = {
            "busy_ms": _union([(e["ts"], e["ts"] + e["dur"]) for e in evs]) / 1e3,
            "kernel_ms": sum(e["dur"] for e in evs if e["cat"] == "kernel") / 1e3,
            "events": len(evs),
        }
    out: dict = {"streams": streams}
    ranges: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "ms": 0.0})
    for e in events:
        if e.get("cat") == "user_annotation":
            ranges[e["name"]]["count"] += 1
            ranges[e["name"]]["ms"] += e["dur"] / 1e3
    out["annotations"] = dict(ranges)
    if not gpu:
        return out
    # The compute stream is the one that launches the most kernels, NCCL's left out. Not the most kernel time: under
    # pipeline parallelism a point-to-point receive is one NCCL kernel that spins until its peer sends, and on a rank
    # that waits a lot those few kernels outlast all of its compute (seen on 2x H100, configuration D).
    compute = max(by_stream, key=lambda s: sum(1 for e in by_stream[s]
                                                if e["cat"] == "kernel" and not _is_nccl(e.get("name", ""))))
    kernels = sorted(by_stream[compute], key=lambda e: e["ts"])
    window = (kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels))
    cpu_bound = gpu_wait = 0.0
    gaps = []
    end = kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        gap = k["ts"] - end
        if gap > gap_us:
            launch = launches.get(k.get("args", {}).get("correlation"))
            launched = launch["ts"] + launch["dur"] if launch else None
            # Launched after the stream went idle: the CPU was late. Launched before: the stream waited.
            late = launched is not None and launched > end
            cpu_part = min(gap, launched - end) if late else 0.0
            cpu_bound += cpu_part
            gpu_wait += gap - cpu_part
            gaps.append({"start_us": end - window[0], "gap_us": gap, "cpu_bound_us": cpu_part,
                         "next": k.get("name", "")[:80]})
        end = max(end, k["ts"] + k["dur"])
    out["compute_stream"] = {
        "stream": str(compute), "window_ms": (window[1] - window[0]) / 1e3,
        "busy_ms": streams[str(compute)]["busy_ms"],
        "idle_ms": (window[1] - window[0]) / 1e3 - streams[str(compute)]["busy_ms"],
        f"gaps_over_{gap_us:g}us": len(gaps), "cpu_bound_ms": cpu_bound / 1e3, "gpu_wait_ms": gpu_wait / 1e3,
        "largest_gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:top],
    }
    copies: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0.0, "ms": 0.0})
    for e in gpu:
        if e["cat"] != "gpu_memcpy":
            continue
        name = e.get("name", "")
        kind = "DtoH" if "DtoH" in name or "Device -> Pinned" in name else (
            "HtoD" if "HtoD" in name or "Pinned -> Device" in name else "other")
        c = copies[kind]
        c["count"] += 1
        c["bytes"] += e.get("args", {}).get("bytes", 0)
        c["ms"] += e["dur"] / 1e3
    for c in copies.values():
        c["GBps"] = c["bytes"] / (c["ms"] * 1e6) if c["ms"] else 0.0
    out["copies"] = dict(copies)
    runtime: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "ms": 0.0})
    for e in events:
        if e.get("cat") == "cuda_runtime" and any(k in e.get("name", "") for k in RUNTIME_OF_INTEREST):
            runtime[e["name"]]["count"] += 1
            runtime[e["name"]]["ms"] += e["dur"] / 1e3
    out["runtime_calls"] = dict(runtime)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    print(json.dumps(analyse(json.loads(Path(args.trace).read_text()), top=args.top), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
