"""Does a small blocking device-to-host read wait for an offload burst running on another stream?

megatron-core's MoE token dispatchers read their token counts on the host once per MoE layer and microbatch (the
all-gather one with ``tensor.cpu()``, the all-to-all one with copies on a side stream and an event sync): small D2H
copies and a host synchronisation. If such a copy queues on the copy engine behind an offload burst of ~100 MiB
issued just before on the D2H side stream, the host waits for the burst, and in a launch-bound step that wait is
step time. (``pretrain_gpt.py --time-syncs`` measures whether it happens in a real step.)

For each case the script issues the burst (or nothing), lets ``--lead-us`` pass, then times ``small.cpu()`` on
the host, ``--reps`` times, and reports the median latency and the burst's own duration and throughput:

- ``idle``: no burst (the latency floor);
- ``d2h_1``, ``d2h_4``, ``d2h_16``: a D2H burst of ``--burst-mib`` MiB into pinned memory as 1, 4 or 16 copies;
- ``h2d_1``: the same bytes host to device (the other direction, for reference);
- ``d2h_1_read_high``: the read on a stream of the highest priority (the burst as in ``d2h_1``; PyTorch's
  default priority 0 is already the lowest, so only the reader's priority can differ).

Run on the GPU host: ``python3 benchmarks/gpu/d2h_contention.py --out OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/, for host_delay
from host_delay import spin  # noqa: E402


def burst(stream: torch.cuda.Stream, dst: list[torch.Tensor], src: list[torch.Tensor]) -> tuple:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    with torch.cuda.stream(stream):
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
    end.record(stream)
    return start, end


def run_case(name: str, pieces: int, direction: str, stream: torch.cuda.Stream, nbytes: int, reps: int,
             lead_us: float, reader: torch.cuda.Stream | None = None) -> dict:
    dev = torch.device("cuda")
    n = nbytes // max(pieces, 1)
    gpu = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(max(pieces, 1))]
    host = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(max(pieces, 1))]
    small = torch.arange(16, device=dev, dtype=torch.long)
    lat, burst_ms = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        ev = None
        if pieces:
            ev = burst(stream, host, gpu) if direction == "d2h" else burst(stream, gpu, host)
        spin(lead_us)
        t0 = time.perf_counter_ns()
        if reader is None:
            small.cpu()
        else:
            reader.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(reader):
                small.cpu()
        lat.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
        if ev is not None:
            burst_ms.append(ev[0].elapsed_time(ev[1]))
    row = {"case": name, "pieces": pieces, "direction": direction, "read_us_median": statistics.median(lat),
           "read_us_min": min(lat), "read_us_max": max(lat)}
    if burst_ms:
        ms = statistics.median(burst_ms)
        row.update(burst_ms_median=ms, burst_GBps=nbytes / ms / 1e6)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--burst-mib", type=int, default=128)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--lead-us", type=float, default=100.0, help="host time between issuing the burst and the read")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    nbytes = args.burst_mib << 20
    side = torch.cuda.Stream()
    lo, hi = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)
    high = torch.cuda.Stream(priority=hi)
    cases = [("idle", 0, "d2h", None), ("d2h_1", 1, "d2h", None), ("d2h_4", 4, "d2h", None),
             ("d2h_16", 16, "d2h", None), ("h2d_1", 1, "h2d", None), ("d2h_1_read_high", 1, "d2h", high)]
    run_case("warmup", 1, "d2h", side, nbytes, 3, args.lead_us)
    rows = []
    for name, pieces, direction, reader in cases:
        row = run_case(name, pieces, direction, side, nbytes, args.reps, args.lead_us, reader)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "burst_mib": args.burst_mib,
              "lead_us": args.lead_us, "reps": args.reps, "priority_range": [lo, hi], "cases": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
