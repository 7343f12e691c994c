"""Host time of one raw ``cudaMemcpyAsync`` (the runtime's copy call) by copy size and by queue depth.

``host_costs.py`` measures copy calls with 64 KiB storages and takes the cost to be independent of the size. Inside
an A step the runtime's copy-out costs about 36 µs of host time per storage of ~17 MiB (session 17's breakdown),
several times that figure. This probe asks whether the call itself costs more for larger copies, or when many bytes
are already queued on the copy stream ahead of it. GPU host, torch only (~1 min):

    python3 benchmarks/gpu/copy_call_size.py --out OUT/copy_call_size.json

For each size and direction: ``idle``, one call with the copy stream drained before it (best of ``--reps`` rounds
of ``--calls`` calls, the stream synchronized after each call); ``queued``, ``--burst`` calls back to back, each
timed, the k-th with k-1 copies of that size still queued (median over rounds per position).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mcore_offload.runtime.cudart import DEVICE_TO_HOST, HOST_TO_DEVICE, load_runtime  # noqa: E402

MiB = 2**20


def time_calls(call, n: int, drain) -> list[float]:
    """Host µs of each of ``n`` calls of ``call(i)``; ``drain()`` after each call when given (else none)."""
    out = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        call(i)
        out.append((time.perf_counter_ns() - t0) / 1e3)
        if drain is not None:
            drain()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[0.0625, 1, 4, 16, 64])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--burst", type=int, default=12)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rt = load_runtime()
    if rt is None:
        sys.exit("copy_call_size: no CUDA runtime is mapped in this process; run it on the GPU host")
    dev = torch.device("cuda")
    stream = torch.cuda.Stream()
    handle = stream.cuda_stream
    rows = []
    for mib in args.sizes_mib:
        n = int(mib * MiB)
        dev_bufs = [torch.empty(n, dtype=torch.uint8, device=dev) for _ in range(args.burst)]
        host_bufs = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(args.burst)]
        for kind, name in ((DEVICE_TO_HOST, "d2h"), (HOST_TO_DEVICE, "h2d")):
            pairs = [(h, d) if kind == DEVICE_TO_HOST else (d, h) for d, h in zip(dev_bufs, host_bufs)]

            def call(i: int, pairs=pairs, kind=kind, n=n) -> None:
                dst, src = pairs[i % len(pairs)]
                rt.memcpy_async(dst.data_ptr(), src.data_ptr(), n, kind, handle)

            for _ in range(3):  # warm-up
                call(0)
            stream.synchronize()
            idle = min(statistics.median(time_calls(call, args.calls, stream.synchronize)) for _ in range(3))
            per_pos: list[list[float]] = [[] for _ in range(args.burst)]
            for _ in range(args.reps):
                stream.synchronize()
                for k, us in enumerate(time_calls(call, args.burst, None)):
                    per_pos[k].append(us)
            stream.synchronize()
            queued = [statistics.median(v) for v in per_pos]
            rows.append({"size_MiB": mib, "direction": name, "idle_us": idle, "queued_us": queued,
                         "queued_mean_us": statistics.mean(queued)})
            print(f"{name} {mib:8.4f} MiB  idle {idle:6.1f} us  queued k=1..{args.burst}: "
                  + " ".join(f"{q:.1f}" for q in queued), flush=True)
        del dev_bufs, host_bufs
    Path(args.out).write_text(json.dumps({
        "what": __doc__.splitlines()[0], "args": vars(args), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(), "host": platform.node(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
