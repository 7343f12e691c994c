"""Host-side cost, in microseconds per call, of each CUDA / autograd primitive the offload hot path uses.

In a launch-bound step (config A on an H100) every microsecond the runtime spends on the host is step time,
so this measures the candidates one by one on the GPU host (no megatron, torch only; ~10 s):

    python3 benchmarks/gpu/host_costs.py --out OUT/host_costs.json

Copies use small storages (64 KiB) so that the GPU never holds the host back: the figure is the launch
cost, which does not depend on the size for pinned, asynchronous copies.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import time
from collections.abc import Callable

import torch


def per_call_us(fn: Callable[[int], object], n: int = 2000, sync: bool = True) -> float:
    """Best of 3 rounds of ``n`` calls, host time per call (µs); the GPU drains between rounds."""
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        if sync:
            torch.cuda.synchronize()
    return best


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, b):
        ctx.a = a
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def cudart():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    n = 2000
    nbytes = 64 * 1024
    srcs = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(64)]
    pinned = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(64)]
    big = torch.empty(64 * nbytes, dtype=torch.uint8, pin_memory=True)  # one buffer, views into it
    views = [big[i * nbytes:(i + 1) * nbytes] for i in range(64)]
    res: dict[str, float] = {}
    with torch.cuda.stream(side):
        res["storage.copy_ D2H pinned (caching host allocator)"] = per_call_us(
            lambda i: pinned[i % 64].untyped_storage().copy_(srcs[i % 64].untyped_storage(), non_blocking=True), n)
        res["tensor.copy_ D2H pinned"] = per_call_us(
            lambda i: pinned[i % 64].copy_(srcs[i % 64], non_blocking=True), n)
        res["tensor.copy_ D2H into a view of a pinned buffer"] = per_call_us(
            lambda i: views[i % 64].copy_(srcs[i % 64], non_blocking=True), n)
        res["storage.copy_ H2D pinned"] = per_call_us(
            lambda i: srcs[i % 64].untyped_storage().copy_(pinned[i % 64].untyped_storage(), non_blocking=True), n)
        lib = cudart()
        if lib is not None:
            lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                            ctypes.c_void_p]
            stream_ptr = side.cuda_stream
            dptr = [s.data_ptr() for s in srcs]
            hptr = [b.data_ptr() for b in pinned]
            res["ctypes cudaMemcpyAsync D2H"] = per_call_us(
                lambda i: lib.cudaMemcpyAsync(hptr[i % 64], dptr[i % 64], nbytes, 2, stream_ptr), n)
    res["record_stream"] = per_call_us(lambda i: srcs[i % 64].record_stream(side), n)
    res["Event() create"] = per_call_us(lambda i: torch.cuda.Event(), n)
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    res["timing Event.record (pooled)"] = per_call_us(lambda i: evs[i].record(side), n)
    ev = torch.cuda.Event()
    ev.record(side)
    cur = torch.cuda.current_stream()
    res["stream.wait_event"] = per_call_us(lambda i: cur.wait_event(ev), n)
    res["stream.wait_stream"] = per_call_us(lambda i: side.wait_stream(cur), n)
    res["torch.cuda.current_stream"] = per_call_us(lambda i: torch.cuda.current_stream(0), n, sync=False)
    raw = getattr(torch._C, "_cuda_setStream", None)
    if raw is not None:
        res["raw set stream (x2)"] = per_call_us(lambda i: (
            raw(stream_id=side.stream_id, device_index=side.device_index, device_type=side.device_type),
            raw(stream_id=cur.stream_id, device_index=cur.device_index, device_type=cur.device_type)), n)
    res["UntypedStorage(64 KiB) alloc+free"] = per_call_us(lambda i: torch.UntypedStorage(nbytes, device=dev), n)
    st = srcs[0].untyped_storage()
    res["empty(0).set_(storage, view)"] = per_call_us(
        lambda i: torch.empty(0, dtype=torch.bfloat16, device=dev).set_(st, 0, (16, 1024), (1024, 1)), n)
    x = torch.randn(1024, device=dev, requires_grad=True)
    res["autograd.Function identity apply (forward)"] = per_call_us(lambda i: Identity.apply(x, None, None), n)

    def chain_backward(k: int) -> float:
        y = x * 1.0
        for _ in range(k):
            y = Identity.apply(y, None, None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.sum().backward()
        return time.perf_counter() - t0

    chain_backward(10)
    res["autograd.Function identity (backward, per node)"] = (
        min(chain_backward(501) for _ in range(3)) - min(chain_backward(1) for _ in range(3))) / 500 * 1e6

    def hooked(i: int) -> None:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            pass

    res["saved_tensors_hooks enter+exit"] = per_call_us(hooked, n, sync=False)
    res["x * 1.0 (one kernel launch, for reference)"] = per_call_us(lambda i: x * 1.0, n)
    res["x * 1.0 then register_hook"] = per_call_us(lambda i: (x * 1.0).register_hook(lambda g: g), n)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
           "per_call_us": {k: round(v, 2) for k, v in res.items()}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for k, v in res.items():
        print(f"{v:8.2f} us  {k}")


if __name__ == "__main__":
    main()
