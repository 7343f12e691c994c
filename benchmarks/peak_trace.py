"""Where one step's device-memory peak is reached, and what was live then (``pretrain_gpt.py --peak-trace``).

The caching allocator's history (``torch.cuda.memory._record_memory_history``) is recorded for the step whose
peak the benchmark reports; the trace is replayed from the allocated bytes at its start, and the JSON gets the
allocation that set the peak (its Python frames: forward or backward, which module) and the bytes live at that
moment that a reload allocated (ours: ``mcore_offload/runtime/transport.py``; upstream's native offloading:
``fine_grained_activation_offload.py``), so two runs that differ in Δpeak can be told apart by moment and by
what each kept on the device.

The replay locates the peak; it does not measure it. On 2x H200 (session 15) its peak differed from the
allocator's maximum (``max_memory_allocated``, also in the JSON) by -128 to +768 MiB, most with upstream's native
offloading, whose forced releases free storages through ``resize_(0)`` after ``record_stream``.
"""

from __future__ import annotations

from typing import Any

import torch

#: where reload allocations come from, by the source file in their frames
RELOAD_SOURCES = {"ours_reload": "mcore_offload/runtime/transport.py",
                  "native_reload": "fine_grained_activation_offload.py"}


def _where(frames: list[dict[str, Any]], depth: int = 14) -> list[str]:
    out = []
    for f in frames[:depth]:
        name = str(f.get("filename", "?")).split("site-packages/")[-1]
        for marker in ("/megatron/", "/mcore_offload/", "/benchmarks/", "/transformer_engine/"):
            if marker in name:
                name = name[name.index(marker) + 1:]
                break
        out.append(f"{name}:{f.get('line', '?')} {f.get('name', '?')}")
    return out


def _signature(frames: list[dict[str, Any]], depth: int = 6) -> str:
    """The call path of an allocation by file and function name only (no line numbers: two megatron-core versions
    can then be compared), over the frames in megatron, TransformerEngine, mcore_offload and the benchmarks."""
    names = []
    for f in frames:
        name = str(f.get("filename", ""))
        if any(m in name for m in ("/megatron/", "/transformer_engine/", "/mcore_offload/", "/benchmarks/")):
            names.append(f"{name.rsplit('/', 1)[-1]}:{f.get('name', '?')}")
            if len(names) == depth:
                break
    return " < ".join(names)


def live_by_site(live: list[dict[str, Any]], top: int = 400) -> list[dict[str, Any]]:
    """The allocations live at the peak, grouped by (size, call path), largest groups first (``top`` of them)."""
    groups: dict[tuple[int, str], int] = {}
    for e in live:
        key = (e["size"], _signature(e.get("frames", [])))
        groups[key] = groups.get(key, 0) + 1
    rows = [{"size": size, "count": n, "bytes": size * n, "where": where} for (size, where), n in groups.items()]
    rows.sort(key=lambda r: -r["bytes"])
    return rows[:top]


def analyse(events: list[dict[str, Any]], base: int) -> dict[str, Any]:
    """Replay ``events`` (one device's allocator trace) from ``base`` allocated bytes: the peak and what was live."""
    cur = peak = base
    at = -1
    for i, e in enumerate(events):
        action = e.get("action")
        if action == "alloc":
            cur += e["size"]
        elif action == "free_completed":
            cur -= e["size"]
        if cur > peak:
            peak, at = cur, i
    live: dict[int, dict[str, Any]] = {}
    for e in events[: at + 1]:
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = e
        elif action == "free_completed":
            live.pop(e["addr"], None)
    by_source = dict.fromkeys(RELOAD_SOURCES, 0)
    for e in live.values():
        files = " ".join(str(f.get("filename", "")) for f in e.get("frames", ()))
        for key, marker in RELOAD_SOURCES.items():
            if marker in files:
                by_source[key] += e["size"]
    peak_event = events[at] if at >= 0 else {}
    return {
        "peak_bytes": peak,
        "base_bytes": base,
        "events": len(events),
        "peak_event_index": at,
        "peak_alloc_bytes": peak_event.get("size"),
        "peak_alloc_where": _where(peak_event.get("frames", [])),
        "live_reload_bytes": by_source,
        "recent_actions": [e.get("action") for e in events[max(0, at - 12): at + 1]],
        # what the step itself allocated and still held at the peak (what it held before is in base_bytes)
        "live_step_bytes": sum(e["size"] for e in live.values()),
        "live_by_site": live_by_site(list(live.values())),
    }


class PeakTrace:
    """Records the allocator's history between :meth:`start` and :meth:`stop` (one step)."""

    def __init__(self, device: torch.device, max_entries: int = 400_000) -> None:
        self.device, self.max_entries, self.base = device, max_entries, 0

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")

    def stop(self) -> dict[str, Any]:
        torch.cuda.synchronize(self.device)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        traces = snapshot.get("device_traces", [])
        result = analyse(traces[index] if index < len(traces) else [], self.base)
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return result
