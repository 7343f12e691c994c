"""What a reload allocation costs under ``torch.use_deterministic_algorithms(True)``, by how it is made.

With the deterministic mode on, ``torch.empty`` fills every new tensor (one fill kernel on the current stream);
Megatron's bitwise-reproducible runs turn the mode on, and so do this project's benchmarks (``--deterministic``).
Session 31's profile of config A showed one fill per reloaded storage. This probe times, per allocation of a reload's
size, the host time and the GPU time a round of allocations adds to the compute stream (its fill kernels, timed
behind a GPU sleep so the host loop is not in it), for: ``torch.empty`` with
the mode on (what the runtime did), ``torch.empty`` with it off, ``torch.UntypedStorage`` (the Python reload path
now) and the C++ runtime's ``empty_storages`` (its reload path now). GPU host, torch only plus the C++ runtime
(~30 s):

    python3 benchmarks/gpu/alloc_fill.py --out OUT/alloc_fill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mcore_offload.runtime.native import load_native  # noqa: E402

MIB = 1 << 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[4, 8, 16, 24],
                   help="reload sizes, cycled (A's attention set reloads storages of a few to a few tens of MiB)")
    p.add_argument("--count", type=int, default=356, help="allocations a round (A's attention set: 356 a step)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--sleep-cycles", type=int, default=100_000_000,
                   help="GPU sleep queued before each round (~50 ms on an H100), longer than the round's host time")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    sizes = [int(args.sizes_mib[i % len(args.sizes_mib)] * MIB) for i in range(args.count)]
    module = load_native()

    def torch_empty():
        return [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]

    def storage():
        return [torch.UntypedStorage(n, device=device) for n in sizes]

    def native():
        return module.empty_storages(sizes, device.index)

    methods = [("torch.empty, deterministic", torch_empty, True), ("torch.empty", torch_empty, False),
               ("torch.UntypedStorage, deterministic", storage, True)]
    if module is not None:
        methods.append(("native empty_storages, deterministic", native, True))
    results = {}
    for name, make, det in methods:
        torch.use_deterministic_algorithms(det)
        host_us, gpu_us = [], []
        for r in range(args.rounds + 2):  # two warm-up rounds: the caching allocator holds the blocks after them
            torch.cuda.synchronize()
            pre, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            # the GPU sleeps while the host allocates, so the events time the queued fills alone, not the host loop
            pre.record()
            torch.cuda._sleep(args.sleep_cycles)
            start.record()
            t0 = time.perf_counter()
            out = make()
            t1 = time.perf_counter()
            end.record()
            torch.cuda.synchronize()
            del out
            if r >= 2:
                if (t1 - t0) * 1e3 >= pre.elapsed_time(start):
                    print(f"{name}: the host loop outlasted the GPU sleep; raise --sleep-cycles", flush=True)
                host_us.append((t1 - t0) * 1e6 / args.count)
                gpu_us.append(start.elapsed_time(end) * 1e3 / args.count)
        results[name] = {"host_us_per_alloc": statistics.median(host_us), "gpu_us_per_alloc": statistics.median(gpu_us),
                         "host_us_min": min(host_us)}
        print(f"{name:<40} host {results[name]['host_us_per_alloc']:7.2f} µs (min {min(host_us):6.2f})  "
              f"GPU {results[name]['gpu_us_per_alloc']:7.2f} µs a allocation", flush=True)
    torch.use_deterministic_algorithms(False)
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "sizes_mib": args.sizes_mib, "count": args.count,
                                              "rounds": args.rounds, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
