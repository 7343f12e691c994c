"""Does the host slowdown a PCIe copy causes depend on the copy's rate, or only on the bytes moved?

Sessions 13 and 14 (``dma_host_contention.py``) found the training thread's Python and launches 10-30 % slower while
the copy engines stream at the link's full rate, and the same bytes moved with no runtime at all cost A `core_attn`
+4.3 % (session 16): the floor under issue 5's "≤ +2 %" rows. If the slowdown grows faster than the rate (a loaded
memory system's latency does), the same bytes spread over more of the compute time (paced: a copy, then a GPU-side
gap on the same stream) would cost less host time in all. If it is linear in the rate, pacing cannot help.

Per condition (``none``, ``d2h``, ``h2d``, ``both`` at each ``--duties`` share of the time copying), many short
windows alternate in a shuffled order: a paced sequence is queued on each of two side streams (8 MiB raw
``cudaMemcpyAsync`` each, then ``torch.cuda._sleep`` for the gap; where a stream carries no traffic in that
condition, a ``_sleep`` of the copy's duration stands in for each copy, so every window of a duty makes the same calls
before it and keeps the same streams busy), and the thread then times a unit of host work
(``mixed``: a tiny kernel launch plus a little dict and list work, the shape of a launch-bound step's host loop)
while the sequence runs; a window that outlived its sequence is not counted. Result per condition: the median µs a
unit, its ratio to ``none`` at the same duty, the copies' achieved GB/s (bytes over the GPU-timed sequence), and
the slowdown per GB/s: ``(ratio - 1) / GBps``; then the same against each window's nearest ``none`` windows in time
(:func:`local_ratios`, the figure to read: the host drifts more than the effect). Equal values across duties mean
the cost is linear in the rate (per byte).

    python3 benchmarks/gpu/dma_pacing.py [--duties 1 0.5 0.25] [--windows 80] [--out dma_pacing.json]

``--host-memory`` takes several kinds; their copy conditions then interleave in the one shuffled run (named
``h2d@1:huge``), against the same ``none`` windows. ``registered`` is anonymous memory page-locked with
``cudaHostRegister``; ``huge`` the same with ``madvise(MADV_HUGEPAGE)`` before it is touched (transparent 2 MiB pages
where the kernel allows them; the share of the buffers that got them is printed): whether the H2D slowdown is the
translation of 4 KiB pages rather than the traffic itself.
"""

from __future__ import annotations

import argparse
import json
import mmap
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mcore_offload.runtime.cudart import (  # noqa: E402
    DEVICE_TO_HOST,
    HOST_ALLOC_WRITE_COMBINED,
    HOST_TO_DEVICE,
    load_runtime,
)

PIECE = 8 << 20  # bytes a copy (~155 µs: few enough queued ops to stay under the launch queue depth)
LINK_GBPS = 54.0  # what a piece's time is planned from; the achieved rate is measured


def sleep_cycles_per_us() -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spins per µs on this device."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(cycles // 10)  # warm
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def queue_paced(rt, direction: str | None, dev: torch.Tensor, host: torch.Tensor, stream: torch.cuda.Stream,
                span_ms: float, duty: float, cycles_us: float) -> tuple[torch.cuda.Event, torch.cuda.Event, int]:
    """Queue about ``span_ms`` of copies at ``duty`` of the time; return (start, end, bytes). ``direction`` None
    queues the same calls with each copy replaced by a ``_sleep`` of its duration: the stream as busy, the same host
    calls before the window, no PCIe traffic (each condition's control)."""
    copy_us = PIECE / (LINK_GBPS * 1e3)
    gap_cycles = int(copy_us * (1 / duty - 1) * cycles_us)
    pieces = max(int(span_ms * 1e3 * duty / copy_us), 1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = dev.numel() // PIECE
    with torch.cuda.stream(stream):
        start.record(stream)
        for i in range(pieces):
            off = (i % n) * PIECE
            if direction == "d2h":
                rt.memcpy_async(host.data_ptr() + off, dev.data_ptr() + off, PIECE, DEVICE_TO_HOST, stream.cuda_stream)
            elif direction == "h2d":
                rt.memcpy_async(dev.data_ptr() + off, host.data_ptr() + off, PIECE, HOST_TO_DEVICE, stream.cuda_stream)
            else:
                torch.cuda._sleep(int(copy_us * cycles_us))
            if gap_cycles:
                torch.cuda._sleep(gap_cycles)
        end.record(stream)
    return start, end, 0 if direction is None else pieces * PIECE


def local_ratios(sequence: list[tuple[str, float]], neighbours: int = 4, draws: int = 1000
                 ) -> dict[str, tuple[float, float, float]]:
    """Per condition, the median ratio of its windows to the median of the ``neighbours`` nearest ``none`` windows
    in time, with a bootstrap 95 % interval: (median, low, high).

    Why not one control median per condition: the host's speed drifts by 20-40 % over a run (session 30's first
    runs: ``none`` windows at different duties, the same work, medians 8.8 and 10.9 µs), far more than the effect,
    and shuffling leaves each condition's median at the mercy of where its windows fell. The ``none`` windows of
    every duty serve as controls, though the calls queued before them differ between duties (a gap kernel per
    piece below duty 1, fewer pieces at low duties); read against each other they stayed within 0.984-1.009 in
    session 30's runs.
    """
    controls = [i for i, (c, _) in enumerate(sequence) if c.startswith("none@")]
    ratios: dict[str, list[float]] = {}
    for i, (cond, us) in enumerate(sequence):
        near = sorted((j for j in controls if j != i), key=lambda j: abs(j - i))[:neighbours]
        if near:
            ratios.setdefault(cond, []).append(us / statistics.median(sequence[j][1] for j in near))
    rng = random.Random(0)
    out = {}
    for cond, r in ratios.items():
        boot = sorted(statistics.median(rng.choices(r, k=len(r))) for _ in range(draws))
        out[cond] = (statistics.median(r), boot[int(0.025 * draws)], boot[int(0.975 * draws) - 1])
    return out


HUGE = 2 << 20


def registered_tensor(nbytes: int, huge: bool, keep: list) -> torch.Tensor:
    """``nbytes`` of anonymous memory, 2 MiB aligned, huge-page advised if ``huge``, touched, then page-locked with
    ``cudaHostRegister`` (the mapping goes into ``keep``: it must outlive the tensor)."""
    m = mmap.mmap(-1, nbytes + HUGE)
    buf = torch.frombuffer(m, dtype=torch.uint8)
    start = -buf.data_ptr() % HUGE
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    t = buf[start:start + nbytes]
    t.fill_(1)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    assert int(err) == 0, f"cudaHostRegister failed: {err}"
    keep.append(m)
    return t


def huge_share(t: torch.Tensor) -> float:
    """The share of ``t``'s bytes backed by transparent huge pages (this process's smaps)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel()
    share, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            a, b = int(m.group(1), 16), int(m.group(2), 16)
            current = a < hi and b > lo
        elif current and line.startswith("AnonHugePages:"):
            share += int(line.split()[1]) * 1024
    return share / t.numel()


def host_work(n: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """µs per unit: one tiny launch and a little Python, the shape of a launch-bound step's host loop."""
    t0 = time.perf_counter_ns()
    for i in range(n):
        torch.add(x, 1.0, out=y)
        d = {"a": i, "b": [i, i + 1], "c": (i,)}
        s = 0
        for k, v in d.items():
            s += len(k) + (len(v) if isinstance(v, (list, tuple)) else v)
    return (time.perf_counter_ns() - t0) / 1e3 / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duties", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    p.add_argument("--windows", type=int, default=80, help="windows per condition")
    p.add_argument("--units", type=int, default=1500, help="host work units a window (~15-25 ms)")
    p.add_argument("--span-ms", type=float, default=90.0, help="queued copy sequence per window")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--host-memory", choices=["pinned", "write-combined", "registered", "huge"], nargs="+",
                   default=["pinned"],
                   help="the host buffers: PyTorch's pinned memory, cudaHostAlloc(cudaHostAllocWriteCombined) "
                        "(MCORE_OFFLOAD_HOST_MEMORY=write-combined in the runtime), or anonymous memory registered "
                        "with cudaHostRegister, with 4 KiB or transparent 2 MiB pages; several interleave")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "needs a GPU"
    rt = load_runtime()
    assert rt is not None, "needs the CUDA runtime PyTorch has mapped (raw copies)"
    devs = {d: torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for d in ("d2h", "h2d")}
    mappings: list = []

    def host_buffer(kind: str) -> torch.Tensor:
        if kind == "write-combined":
            return rt.host_tensor(256 << 20, HOST_ALLOC_WRITE_COMBINED)
        if kind in ("registered", "huge"):
            return registered_tensor(256 << 20, kind == "huge", mappings)
        return torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)

    memories = list(dict.fromkeys(args.host_memory))
    host_sets = {mem: {d: host_buffer(mem) for d in ("d2h", "h2d")} for mem in memories}
    shares = {mem: min(huge_share(t) for t in hs.values()) for mem, hs in host_sets.items()
              if mem in ("registered", "huge")}
    if shares:
        print("huge-page share of the host buffers: " + ", ".join(f"{m} {v:.2f}" for m, v in shares.items()))
    streams = {d: torch.cuda.Stream() for d in ("d2h", "h2d")}
    x, y = torch.zeros(256, device="cuda"), torch.empty(256, device="cuda")
    cycles_us = sleep_cycles_per_us()
    # every window queues both streams' sequences (copies or their sleep stand-ins), so every condition makes the
    # same host calls before its window and keeps the same streams busy: only the PCIe traffic differs
    kinds = {"none": (), "d2h": ("d2h",), "h2d": ("h2d",), "both": ("d2h", "h2d")}
    suffix = {mem: f":{mem}" if len(memories) > 1 else "" for mem in memories}
    conditions = [f"{k}@{duty:g}{'' if k == 'none' else suffix[mem]}" for duty in args.duties for k in kinds
                  for mem in (memories[:1] if k == "none" else memories)]
    memory_of = {c: next((m for m in memories if suffix[m] and c.endswith(suffix[m])), memories[0])
                 for c in conditions}
    host_work(args.units // 4, x, y)
    torch.cuda.synchronize()
    work: dict[str, list[float]] = {c: [] for c in conditions}
    rates: dict[str, dict[str, list[float]]] = {c: {"d2h": [], "h2d": []} for c in conditions}
    outlived = {c: 0 for c in conditions}
    sequence: list[tuple[str, float]] = []  # counted windows in time order, for the time-local ratios
    order = [c for c in conditions for _ in range(args.windows)]
    random.Random(args.seed).shuffle(order)
    for i, cond in enumerate(order):
        kind, _, duty = cond.partition("@")
        duty = duty.partition(":")[0]
        hosts = host_sets[memory_of[cond]]
        spans = [(d, *queue_paced(rt, d if d in kinds[kind] else None, devs[d], hosts[d], streams[d], args.span_ms,
                                  float(duty), cycles_us)) for d in ("d2h", "h2d")]
        time.sleep(0.002)  # let the copies start
        us = host_work(args.units, x, y)
        ended = any(e.query() for _, _, e, _ in spans)
        torch.cuda.synchronize()
        if ended:
            outlived[cond] += 1
        else:
            work[cond].append(us)
            sequence.append((cond, us))
            for direction, start, end, nbytes in spans:
                if nbytes:
                    rates[cond][direction].append(nbytes / (start.elapsed_time(end) * 1e6))
        if (i + 1) % 100 == 0:
            print(f"window {i + 1}/{len(order)}", file=sys.stderr, flush=True)
    rows = {}
    print(f"{'condition':<12}{'windows':>8}{'us/unit':>10}{'x none':>8}{'GB/s':>14}{'(x-1)/GBps %':>15}")
    for c in conditions:
        control = work[f"none@{c.partition('@')[2].partition(':')[0]}"]
        if not work[c] or not control:
            rows[c] = {"windows": len(work[c]), "outlived": outlived[c]}
            print(f"{c:<12}{len(work[c]):>8}  (no windows here or in its control: raise --span-ms)")
            continue
        med, base = statistics.median(work[c]), statistics.median(control)
        gbps = {d: statistics.median(v) for d, v in rates[c].items() if v}
        total = sum(gbps.values())
        per = (med / base - 1) / total * 100 if total else None
        rows[c] = {"windows": len(work[c]), "outlived": outlived[c], "us_per_unit": med, "ratio_to_none": med / base,
                   "GBps": gbps, "slowdown_pct_per_GBps": per}
        print(f"{c:<12}{len(work[c]):>8}{med:>10.3f}{med / base:>8.3f}"
              f"{' + '.join(f'{v:.1f}' for v in gbps.values()) or '-':>14}"
              f"{'' if per is None else f'{per:.3f}':>15}")
    local = local_ratios(sequence)
    print(f"{'condition':<12}{'x nearest none windows [95 %]':>32}{'GB/s':>14}{'(x-1)/GBps %':>15}")
    for c in conditions:
        if c not in local:
            continue
        med, lo, hi = local[c]
        total = sum(rows[c].get("GBps", {}).values())
        rows[c]["local_ratio"] = [med, lo, hi]
        rows[c]["local_slowdown_pct_per_GBps"] = (med - 1) / total * 100 if total else None
        print(f"{c:<12}{f'{med:.3f} [{lo:.3f}, {hi:.3f}]':>32}{total:>14.1f}"
              f"{'' if not total else f'{(med - 1) / total * 100:.3f}':>15}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args),
            "sleep_cycles_per_us": cycles_us, "huge_page_share": shares, "piece_bytes": PIECE,
            "conditions": rows, "raw_us": work, "sequence": sequence}, indent=1))
    for mem in memories:  # unregistered before the mappings go
        if mem in ("registered", "huge"):
            for t in host_sets[mem].values():
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
