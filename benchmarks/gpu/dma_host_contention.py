"""Does a copy burst over PCIe slow the host thread that launches the model's kernels?

In a launch-bound step every microsecond of host time is step time. The A attention set costs more step time than
the runtime's own host time, and the gap grows with the bytes moved. One candidate: the copy engines write (D2H) or
read (H2D) pinned host memory at ~55 GB/s, and the training thread's Python and driver code, which misses its caches
a lot, shares that memory. This script measures host work with and without a long copy burst queued on side
streams (queued before timing starts, so the measured thread issues no copies itself):

- ``launch``: tiny kernels on the default stream (``torch.add(..., out=...)``), µs per launch;
- ``python``: pure-Python dict and list work, µs per round (no CUDA);
- ``event``: ``cudaEventRecord`` + ``cudaEventQuery`` through PyTorch, µs per pair;
- ``memcpy``: a 32 MiB host memcpy (numpy), µs (memory bandwidth).

Conditions: ``idle``, and ``d2h``, ``h2d``, ``both`` for each host memory kind (``--host-memory``: ``pinned``, PyTorch's
page-locked memory; ``write-combined``, ``cudaHostAlloc(cudaHostAllocWriteCombined)``, which PCIe transfers do not
snoop in the CPU's caches), alternated over rounds; the result is each condition's median over rounds and its ratio
to ``idle``, with the copies' GB/s. A check at the end of each window says whether the burst was still running. The
copies are raw ``cudaMemcpyAsync`` calls (``mcore_offload.runtime.cudart``), as the runtime issues them.

    python3 benchmarks/gpu/dma_host_contention.py --host-memory pinned write-combined --out dma_host_contention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mcore_offload.runtime.cudart import DEVICE_TO_HOST, HOST_ALLOC_WRITE_COMBINED, HOST_TO_DEVICE, load_runtime  # noqa: E402

CHUNK = 256 << 20


def _queue_burst(kind: str, rt, dev: torch.Tensor, host: torch.Tensor, streams: dict[str, torch.cuda.Stream],
                 copies: int) -> list[tuple[str, torch.cuda.Event, torch.cuda.Event]]:
    """Queue ``copies`` raw copies of CHUNK bytes per direction; return (direction, start, end) per direction."""
    spans = []
    for direction in ("d2h", "h2d") if kind == "both" else (kind,):
        s = streams[direction]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(s)
        for _ in range(copies):
            if direction == "d2h":
                rt.memcpy_async(host.data_ptr(), dev.data_ptr(), CHUNK, DEVICE_TO_HOST, s.cuda_stream)
            else:
                rt.memcpy_async(dev.data_ptr(), host.data_ptr(), CHUNK, HOST_TO_DEVICE, s.cuda_stream)
        end.record(s)
        spans.append((direction, start, end))
    return spans


def _work(what: str, n: int, x: torch.Tensor, y: torch.Tensor, a: np.ndarray, b: np.ndarray) -> float:
    """µs per unit of ``what``."""
    t0 = time.perf_counter_ns()
    if what == "launch":
        for _ in range(n):
            torch.add(x, 1.0, out=y)
    elif what == "python":
        for i in range(n):
            d = {"a": i, "b": [i, i + 1], "c": (i,)}
            s = 0
            for k, v in d.items():
                s += len(k) + (len(v) if isinstance(v, (list, tuple)) else v)
    elif what == "event":
        ev = torch.cuda.Event()
        for _ in range(n):
            ev.record()
            ev.query()
    elif what == "memcpy":
        for _ in range(n):
            np.copyto(b, a)
    return (time.perf_counter_ns() - t0) / 1e3 / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--copies", type=int, default=32,
                   help="256 MiB copies queued per direction and measurement (~150 ms)")
    p.add_argument("--host-memory", nargs="+", default=["pinned", "write-combined"],
                   choices=["pinned", "write-combined"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "needs a GPU"
    dev = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
    rt = load_runtime()
    assert rt is not None, "needs the CUDA runtime PyTorch has mapped (raw copies)"
    hosts = {"pinned": torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)}
    if "write-combined" in args.host_memory:
        hosts["write-combined"] = rt.host_tensor(CHUNK, HOST_ALLOC_WRITE_COMBINED)
    streams = {"d2h": torch.cuda.Stream(), "h2d": torch.cuda.Stream()}
    x = torch.zeros(256, device="cuda")
    y = torch.empty_like(x)
    a = np.ones(32 << 20, dtype=np.uint8)
    b = np.empty_like(a)
    sizes = {"launch": 3000, "python": 20000, "event": 2000, "memcpy": 6}  # each about 30-40 ms
    conditions = ("idle",) + tuple(f"{k}/{m}" for m in args.host_memory for k in ("d2h", "h2d", "both"))
    results: dict[str, dict[str, list[float]]] = {c: {w: [] for w in sizes} for c in conditions}
    still_running: dict[str, list[bool]] = {c: [] for c in conditions}
    gbps: dict[str, dict[str, list[float]]] = {c: {"d2h": [], "h2d": []} for c in conditions}
    for w, n in sizes.items():  # warm-up
        _work(w, n // 4, x, y, a, b)
    torch.cuda.synchronize()
    for r in range(args.rounds):
        order = conditions if r % 2 == 0 else tuple(reversed(conditions))
        for cond in order:
            for w, n in sizes.items():
                # a fresh burst per measurement, long enough to outlast it (checked at its end)
                kind, _, memory = cond.partition("/")
                spans = [] if cond == "idle" else _queue_burst(kind, rt, dev, hosts[memory], streams, args.copies)
                time.sleep(0.002)  # let the copies start
                results[cond][w].append(_work(w, n, x, y, a, b))
                still_running[cond].append(bool(spans) and not all(e.query() for _, _, e in spans))
                torch.cuda.synchronize()
                for direction, start, end in spans:
                    gbps[cond][direction].append(args.copies * CHUNK / start.elapsed_time(end) / 1e6)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    summary = {}
    for cond in conditions:
        summary[cond] = {w: statistics.median(v) for w, v in results[cond].items()}
    ratios = {c: {w: summary[c][w] / summary["idle"][w] for w in sizes} for c in conditions}
    link = {c: {d: statistics.median(v) for d, v in g.items() if v} for c, g in gbps.items()}
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sizes": sizes, "link_GBps": link,
           "copies_per_window": args.copies, "chunk_bytes": CHUNK, "median_us": summary, "ratio_to_idle": ratios,
           "burst_still_running_at_window_end": still_running, "raw_us": results}
    print(f"{'condition':<22}" + "".join(f"{w + ' us':>14}{'x idle':>8}" for w in sizes) + "  link GB/s")
    for c in conditions:
        print(f"{c:<22}" + "".join(f"{summary[c][w]:>14.3f}{ratios[c][w]:>8.3f}" for w in sizes)
              + "  " + " ".join(f"{d} {v:.1f}" for d, v in link[c].items()))
    print("share of measurements that ended inside their burst:",
          {c: round(sum(v) / len(v), 2) for c, v in still_running.items() if c != "idle"})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
