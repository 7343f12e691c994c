"""A happens-before check of the CUDA calls the raw transport makes, from a logging stub runtime
(``benchmarks/cpu_transport_glue.py`` built with ``log=True``): tests/test_stream_order.py and
tests/test_raw_transport_stub_pp.py."""

from __future__ import annotations

import itertools
from typing import Any

from mcore_offload.runtime import cudart

D2H, H2D = cudart.DEVICE_TO_HOST, cudart.HOST_TO_DEVICE


def hazards(calls: list[tuple], host_ranges: list[tuple[int, int]]) -> list[str]:
    """The stream-order violations in ``calls`` (``cpu_transport_glue.stub_calls``) on the host memory in
    ``host_ranges`` (start, end): see the module docstring."""
    clocks: dict[int, dict[int, int]] = {}  # stream -> its vector clock
    events: dict[int, dict[int, int]] = {}  # event -> the clock of its latest record
    known: dict[int, int] = {}  # what the host has seen complete (queries)

    def join(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
        return {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}

    def on_host(addr: int) -> bool:
        return any(lo <= addr < hi for lo, hi in host_ranges)

    reads: list[tuple[int, int, int, dict]] = []  # H2D: (start, end, stream, clock)
    writes: list[tuple[int, int, int, dict]] = []  # D2H
    problems = []
    for call in calls:
        op = call[0]
        if op == "query":
            known = join(known, events.get(call[1], {}))
            continue
        stream = call[2] if op == "record" else call[1] if op == "wait" else call[5]
        clock = join(clocks.get(stream, {}), known)
        if op == "wait":
            clocks[stream] = join(clock, events.get(call[2], {}))
            continue
        clock[stream] = clock.get(stream, 0) + 1
        clocks[stream] = clock
        if op == "record":
            events[call[1]] = dict(clock)
            continue
        _, dst, src, n, kind, _ = call
        if kind == D2H and on_host(dst):
            for lo, hi, s, c in reads:
                if lo < dst + n and dst < hi and c[s] > clock.get(s, 0):
                    problems.append(f"D2H into {dst:#x} not ordered after the H2D that read it")
            writes.append((dst, dst + n, stream, dict(clock)))
        elif kind == H2D and on_host(src):
            last = [w for w in writes if w[0] < src + n and src < w[1]]
            if not last or last[-1][3][last[-1][2]] > clock.get(last[-1][2], 0):
                problems.append(f"H2D from {src:#x} not ordered after the D2H that filled it")
            reads.append((src, src + n, stream, dict(clock)))
    return problems


def logging_transport(rt: cudart.CudaRuntime, glue: Any) -> Any:
    """``glue.stub_transport`` on ``rt`` with distinct event handles (the glue benchmark's stub reuses one, which
    a happens-before replay cannot tell apart); recycled handles come back as on the GPU."""
    from mcore_offload.runtime import transport as transport_module
    from mcore_offload.runtime.native import load_native

    t = glue.stub_transport(rt, device_index=-1)
    t.native = load_native()
    handles = itertools.count(100)
    free = t._timed_events.free
    t._timed_events.get = lambda: cudart.RawEvent(rt, free.pop() if free else next(handles), free)
    t.telemetry = transport_module.LinkTelemetry(t._timed_events.get, every=4)
    return t


def host_ranges(t: Any) -> list[tuple[int, int]]:
    """The transport's pooled host buffers (every one is back in the pool once the steps finished)."""
    pool = t.pool
    bufs = [b for free in pool._free.values() for b, _ in free] + [b for free in pool._routed_free.values()
                                                                    for b, _ in free]
    return [(b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs]
