"""A happens-before check of the CUDA calls the raw transport makes, from a logging stub runtime
(``benchmarks/cpu_transport_glue.py`` built with ``log=True``): tests/test_stream_order.py and
tests/test_raw_transport_stub_pp.py."""

from __future__ import annotations

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


def reuse_waits(calls: list[tuple], t: Any) -> int:
    """Waits of the copy-out stream other than on its fence: a reused buffer waiting for its last reload (none is
    needed where the compute stream already waited for that reload)."""
    return sum(1 for c in calls if c[0] == "wait" and c[1] == t._d2h_handle and c[2] != t._d2h_fence.handle)


def host_ranges(t: Any) -> list[tuple[int, int]]:
    """The transport's pooled host buffers (every one is back in the pool once the steps finished)."""
    pool = t.pool
    bufs = [b for free in pool._free.values() for b, _ in free] + [b for free in pool._routed_free.values()
                                                                    for b, _ in free]
    return [(b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs]
