"""Training-thread host time of one offload copy burst: inline CUDA calls against the copy engine's thread.

An emulated launch-bound layer (many small kernels and a few GEMMs, as in config A on an H100) runs in a loop; each
layer also offloads three 2 MiB storages (D2H burst) and reloads three (H2D burst, the compute stream waits on it),
the calls a group of ``core_attn`` makes. The figure is the training thread's extra wall time per layer over the
same loop without copies. GPU host, torch only (no megatron, ~30 s):

    python3 benchmarks/gpu/copy_thread_cost.py --out OUT/copy_thread_cost.json
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import copy_engine as ce  # noqa: E402
from graph_burst import GraphBurst, GraphRuntime  # noqa: E402

from mcore_offload.runtime.cudart import DEVICE_TO_HOST, HOST_TO_DEVICE, EventPool, load_runtime  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=300)
    p.add_argument("--small", type=int, default=60, help="tiny kernels per layer")
    p.add_argument("--gemms", type=int, default=4,
                   help="4096x2048x2048 GEMMs per layer (default 4: the loop is launch-bound; 40 with --small 10 "
                        "makes it GPU-bound, so the launch queue fills and the host runs ahead)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--variants", default="none inline thread thread_spin thread_noreap",
                   help="of: none inline inline_x2 inline_batch inline_graph inline_graph_ev thread thread_spin "
                        "thread_noreap (inline_x2: two layers' burst pairs together every other layer; inline_batch: "
                        "each burst's copies as one cudaMemcpyBatchAsync; inline_graph: each burst's copies as one "
                        "CUDA graph launch, its copy nodes given the burst's addresses first; inline_graph_ev: the "
                        "side stream's fence wait and done record inside the graph too; see graph_burst.py)")
    p.add_argument("--storage-mib", type=float, default=2.0,
                   help="bytes of each of the three storages per direction (default 2: the link never holds the loop "
                        "back, so the figure is host time; A's storages are ~17 MiB)")
    p.add_argument("--pollute-mib", type=float, default=0.0,
                   help="before each burst, write this many MiB of host memory (evicts the CPU's data caches, as a "
                        "step's Python and kernels launched between two bursts do; untimed in burst_call_us)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    dev = torch.device("cuda", 0)
    rt = load_runtime()
    assert rt is not None, "no mapped CUDA runtime"
    lib = ce.load_library(ce.build_library())
    engine = ce.CopyEngine(lib, rt.function_addresses(), 0, rt.error_string)
    pool = EventPool(rt, 0, timed=False)
    blocking = EventPool(rt, 0, timed=False, blocking=True)
    d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()
    d2h_h, h2d_h = d2h.cuda_stream, h2d.cuda_stream
    fence_d, fence_h = pool.get(), pool.get()

    x = torch.zeros(16, device=dev)
    a = torch.randn(4096, 2048, device=dev, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    nbytes = int(args.storage_mib * 2**20)
    srcs = [torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev) for _ in range(3)]
    hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
    dsts = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(3)]

    def compute() -> int:
        return torch._C._cuda_getCurrentRawStream(0)

    graphs: dict[str, tuple[GraphBurst, GraphBurst]] = {}
    want = args.variants.split()
    if "inline_graph" in want or "inline_graph_ev" in want:
        grt = GraphRuntime(rt)
        for v, with_events in (("inline_graph", False), ("inline_graph_ev", True)):
            if v in want:
                graphs[v] = (GraphBurst(grt, d2h_h, 3, DEVICE_TO_HOST, with_events),
                             GraphBurst(grt, h2d_h, 3, HOST_TO_DEVICE, with_events))

    def burst_graph(variant: str) -> None:
        out, back_g = graphs[variant]
        rec, wait = rt.event_record, rt.stream_wait
        c = compute()
        rec(fence_d.handle, c)
        done = pool.get()
        if out.with_events:  # the graph waits on the fence and records ``done`` itself
            out.launch([h.data_ptr() for h in hosts], [s.data_ptr() for s in srcs], nbytes, fence_d.handle,
                       done.handle)
        else:
            wait(d2h_h, fence_d.handle, 0)
            out.launch([h.data_ptr() for h in hosts], [s.data_ptr() for s in srcs], nbytes)
            rec(done.handle, d2h_h)
        rec(fence_h.handle, c)
        wait(h2d_h, done.handle, 0)
        back = pool.get()
        if back_g.with_events:
            back_g.launch([d.data_ptr() for d in dsts], [h.data_ptr() for h in hosts], nbytes, fence_h.handle,
                          back.handle)
        else:
            wait(h2d_h, fence_h.handle, 0)
            back_g.launch([d.data_ptr() for d in dsts], [h.data_ptr() for h in hosts], nbytes)
            rec(back.handle, h2d_h)
        wait(c, back.handle, 0)

    def layer_work() -> None:
        for _ in range(args.small):
            x.add_(1.0)
        for _ in range(args.gemms):
            torch.mm(a, b)

    def burst_inline(batch: bool = False) -> None:
        rec, wait, cp = rt.event_record, rt.stream_wait, rt.memcpy
        c = compute()
        rec(fence_d.handle, c)
        wait(d2h_h, fence_d.handle, 0)
        if batch:
            rt.memcpy_many([h.data_ptr() for h in hosts], [s.data_ptr() for s in srcs], [nbytes] * 3, d2h_h)
        else:
            for s, h in zip(srcs, hosts):
                cp(h.data_ptr(), s.data_ptr(), nbytes, DEVICE_TO_HOST, d2h_h)
        done = pool.get()
        rec(done.handle, d2h_h)
        rec(fence_h.handle, c)
        wait(h2d_h, fence_h.handle, 0)
        wait(h2d_h, done.handle, 0)
        if batch:
            rt.memcpy_many([d.data_ptr() for d in dsts], [h.data_ptr() for h in hosts], [nbytes] * 3, h2d_h)
        else:
            for d, h in zip(dsts, hosts):
                cp(d.data_ptr(), h.data_ptr(), nbytes, HOST_TO_DEVICE, h2d_h)
        back = pool.get()
        rec(back.handle, h2d_h)
        wait(c, back.handle, 0)

    held = []

    def burst_thread(reap: bool = True, events: EventPool = blocking, timed: list[float] | None = None) -> None:
        b0 = time.perf_counter()
        c = compute()
        done = events.get()
        ops = [ce.OP_RECORD, fence_d.handle, c, ce.OP_WAIT, d2h_h, fence_d.handle]
        for s, h in zip(srcs, hosts):
            ops += (ce.OP_COPY, h.data_ptr(), s.data_ptr(), nbytes, DEVICE_TO_HOST, d2h_h)
        ops += (ce.OP_RECORD, done.handle, d2h_h)
        if reap:
            held.append((engine.completion(ops, done.handle), done))
        engine.submit(ops)
        while held and engine.completed(held[0][0]):
            held.pop(0)
        back = pool.get()
        ops = [ce.OP_RECORD, fence_h.handle, c, ce.OP_WAIT, h2d_h, fence_h.handle, ce.OP_WAIT, h2d_h, done.handle]
        for d, h in zip(dsts, hosts):
            ops += (ce.OP_COPY, d.data_ptr(), h.data_ptr(), nbytes, HOST_TO_DEVICE, h2d_h)
        ops += (ce.OP_RECORD, back.handle, h2d_h)
        job = engine.submit(ops)
        b1 = time.perf_counter()
        layer_work()  # the reload is awaited a layer's work later, as the prefetch does
        b2 = time.perf_counter()
        engine.wait_issued(job)
        rt.stream_wait(c, back.handle, 0)
        if timed is not None:  # the training thread's own time in the burst pair, the layer's work left out
            timed.append((b1 - b0 + time.perf_counter() - b2) * 1e6)

    # the inline variants' own calls, timed around each burst pair (a direct figure, free of the loop's own noise
    # that the per-layer difference carries; it leaves out any cost the calls push onto later launches)
    call_us: dict[str, list[float]] = {v: [] for v in args.variants.split()}

    pollution = torch.zeros(int(args.pollute_mib * 2**20), dtype=torch.uint8) if args.pollute_mib else None

    def run(variant: str) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(args.layers):
            layer_work()
            if pollution is not None:
                pollution.add_(1)
            if variant == "inline_x2":  # two layers' burst pairs back to back every other layer: a cold start shared
                if layer % 2:
                    b0 = time.perf_counter()
                    burst_inline()
                    burst_inline()
                    call_us[variant].append((time.perf_counter() - b0) / 2 * 1e6)  # per layer, as the others
                layer_work()
            elif variant in ("inline", "inline_batch"):
                b0 = time.perf_counter()
                burst_inline(batch=variant == "inline_batch")
                call_us[variant].append((time.perf_counter() - b0) * 1e6)
                layer_work()
            elif variant in graphs:
                b0 = time.perf_counter()
                burst_graph(variant)
                call_us[variant].append((time.perf_counter() - b0) * 1e6)
                layer_work()
            elif variant == "thread":
                burst_thread(timed=call_us[variant])
            elif variant == "thread_spin":  # the reaper synchronizes on spinning (default-flag) events
                burst_thread(events=pool, timed=call_us[variant])
            elif variant == "thread_noreap":
                burst_thread(reap=False, timed=call_us[variant])
            else:
                layer_work()
        host = time.perf_counter() - t0
        engine.drain()
        torch.cuda.synchronize()
        return host / args.layers * 1e6

    variants = tuple(args.variants.split())
    assert variants[0] == "none", "the first variant is the reference: none"
    for v in graphs:  # a graph burst pair must move the bytes: out and back into zeroed buffers
        for t in hosts + dsts:
            t.zero_()
        torch.cuda.synchronize()
        burst_graph(v)
        torch.cuda.synchronize()
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs)), f"{v}: graph round trip mismatch"
    assert "inline_batch" not in variants or rt.memcpy_batch is not None, "no cudaMemcpyBatchAsync (CUDA < 13)"
    for v in variants:  # warm-up
        run(v)
    for t in call_us.values():
        t.clear()
    res: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.reps):
        for v in res:
            res[v].append(run(v))
    # round trip check: what came back equals what left
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s), "copy engine round trip mismatch"
    med = {v: statistics.median(t) for v, t in res.items()}
    out = {
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "python": platform.python_version(),
        "layers": args.layers, "small_kernels": args.small, "gemms": args.gemms, "storage_MiB": args.storage_mib,
        "pollute_MiB": args.pollute_mib,
        "host_us_per_layer": res, "median_us_per_layer": med,
        "burst_us": {v: med[v] - med["none"] for v in variants[1:]},
        "burst_call_us": {v: {"median": round(statistics.median(t), 2), "q10": round(sorted(t)[len(t) // 10], 2),
                              "n": len(t)} for v, t in call_us.items() if t},
        "engine_counters": [engine.counters[i] for i in range(6)],
    }
    engine.stop()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("median_us_per_layer", "burst_us", "burst_call_us")}, indent=1))


if __name__ == "__main__":
    main()
