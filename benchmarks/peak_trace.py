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

``--peak-trace-census`` records from the launch instead, and also itemizes what is allocated at the peak step's start
once its ``zero_grad`` has run (:func:`census`: weights, persistent buffers and workspaces, by call path): the part of
a peak the planner (``mcore_offload/plan``) counts as static, against what it does count.
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


def census(segments: list[dict[str, Any]], device: int, top: int = 200) -> dict[str, Any]:
    """The blocks allocated on ``device`` in an allocator snapshot's ``segments``, grouped by (size, call path)
    as :func:`live_by_site` does; blocks allocated before recording began have no frames (call path "")."""
    blocks = [{"size": b["size"], "frames": b.get("frames", [])}
              for seg in segments if seg.get("device") == device
              for b in seg.get("blocks", ()) if b.get("state") == "active_allocated"]
    return {"allocated_bytes": sum(b["size"] for b in blocks), "blocks": len(blocks),
            "by_site": live_by_site(blocks, top)}


class PeakTrace:
    """Records the allocator's history between :meth:`start` and :meth:`stop` (one step); with ``from_launch``
    (:meth:`record_from_launch` called before the model is built) it keeps recording from then on, replays only the
    events after :meth:`start`, and :meth:`take_census` itemizes what is allocated when it is called."""

    def __init__(self, device: torch.device, max_entries: int = 400_000, from_launch: bool = False) -> None:
        self.device, self.max_entries, self.base = device, max_entries, 0
        self.from_launch, self.offset = from_launch, 0
        self.census: dict[str, Any] | None = None

    @property
    def index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    @staticmethod
    def record_from_launch(max_entries: int = 400_000) -> None:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")

    def _trace(self, snapshot: dict[str, Any]) -> list[dict[str, Any]]:
        traces = snapshot.get("device_traces", [])
        return traces[self.index] if self.index < len(traces) else []

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        if self.from_launch:  # already recording: the step's events are those after this point
            self.offset = len(self._trace(torch.cuda.memory._snapshot()))
        else:
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")

    def take_census(self) -> None:
        torch.cuda.synchronize(self.device)
        self.census = census(torch.cuda.memory._snapshot().get("segments", []), self.index)

    def stop(self) -> dict[str, Any]:
        torch.cuda.synchronize(self.device)
        trace = self._trace(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
        # a full ring buffer has dropped its oldest events, the offset no longer points at the step's start
        wrapped = self.from_launch and len(trace) >= self.max_entries
        result = analyse([] if wrapped else trace[self.offset:], self.base)
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        result["history_wrapped"] = wrapped
        if self.census is not None:
            result["census"] = self.census
        return result
