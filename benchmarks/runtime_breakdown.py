"""Inclusive host time per runtime function, for finding where the offload runtime's own time goes.

``pretrain_gpt.py --runtime-breakdown`` installs timing wrappers around the runtime's hot-path functions
(pack / unpack hooks, flush, reloads, the autograd identity functions, the transport's copy bursts) and
reports, per timed step, the microseconds and calls of each. Times are inclusive (``flush`` contains
``to_host``), and each wrapped call adds the wrapper's own cost, measured and reported as ``wrapper_us``:
compare the total with a run without the flag before trusting small rows.

Benchmark tooling only: the library never imports this module.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections import Counter
from time import perf_counter_ns
from typing import Any

#: (module, attribute path[, label]) of every timed function; missing ones are skipped (older or newer runtimes)
TARGETS = [
    ("mcore_offload.runtime.points", "offload"),
    ("mcore_offload.runtime.points", "commit"),
    ("mcore_offload.runtime.points", "GroupStart.apply"),
    ("mcore_offload.runtime.points", "GroupCommit.apply"),
    # the runtime calls the C entry of apply through these module names (same labels as above)
    ("mcore_offload.runtime.points", "_start", "GroupStart.apply"),
    ("mcore_offload.runtime.points", "_commit_node", "GroupCommit.apply"),
    ("mcore_offload.runtime.points", "GroupStart.backward"),
    ("mcore_offload.runtime.points", "GroupCommit.backward"),
    # node hooks (MCORE_OFFLOAD_NODE_HOOKS, the default): the same moments as the identity nodes, same labels
    ("mcore_offload.runtime.points", "_start_group", "GroupStart.apply"),
    ("mcore_offload.runtime.points", "_commit_group", "GroupCommit.apply"),
    ("mcore_offload.runtime.points", "StartHook.__call__", "GroupStart.backward"),
    ("mcore_offload.runtime.points", "CommitHook.__call__", "GroupCommit.backward"),
    ("mcore_offload.runtime.manager", "OffloadManager.begin_chunk"),
    ("mcore_offload.runtime.manager", "OffloadManager.layer_boundary"),
    ("mcore_offload.runtime.manager", "OffloadManager.handler_for"),
    ("mcore_offload.runtime.manager", "OffloadManager.on_offloaded"),
    ("mcore_offload.runtime.manager", "OffloadManager.on_released"),
    ("mcore_offload.runtime.manager", "OffloadManager.on_reloaded"),
    ("mcore_offload.runtime.manager", "OffloadManager.end_step"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler.open_group"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler.tensor_push"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler.tensor_pop"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler.on_group_commit_forward"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler.flush"),
    ("mcore_offload.runtime.handler", "_held_elsewhere"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler.on_group_commit_backward"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler._reload"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler._prefetch"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler.on_group_backward_done"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler.finish"),
    # chunk-level steps (sixteen chunk forwards and backwards a step on D's ranks, four on A)
    ("mcore_offload.runtime.manager", "OffloadManager.end_chunk"),
    ("mcore_offload.runtime.manager", "OffloadManager.on_backward"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler.on_chunk_backward_start"),
    ("mcore_offload.runtime.handler", "ChunkOffloadHandler.second_look"),
    ("mcore_offload.runtime.transport", "CudaTransport.to_host"),
    ("mcore_offload.runtime.transport", "CudaTransport.to_device"),
    ("mcore_offload.runtime.transport", "CudaTransport.wait"),
    ("mcore_offload.runtime.transport", "copy_into_host"),
    ("mcore_offload.runtime.transport", "HostBufferPool.acquire"),
    ("mcore_offload.runtime.telemetry", "LinkTelemetry.mark"),
    ("mcore_offload.runtime.telemetry", "LinkTelemetry.resolve"),
    ("mcore_offload.summary", "OffloadSummary.close_step"),
    ("mcore_offload.runtime.transport", "Transport.to_host"),
    ("mcore_offload.runtime.transport", "Transport.to_device"),
    # the raw-copy transport (the GPU default) overrides the methods above
    ("mcore_offload.runtime.raw_transport", "RawCudaTransport.to_host"),
    ("mcore_offload.runtime.raw_transport", "RawCudaTransport.to_device"),
    ("mcore_offload.runtime.raw_transport", "RawCudaTransport._copy_burst"),
    ("mcore_offload.runtime.raw_transport", "RawCudaTransport.wait"),
    ("mcore_offload.runtime.transport", "CudaTransport.release_copied"),
    ("mcore_offload.runtime.transport", "HostBufferPool.acquire_base"),
]


def _native_module() -> Any:
    """The runtime's C++ module if it is loaded or loads (None where it does not build, or is off)."""
    try:
        from mcore_offload.runtime.native import load_native
    except ImportError:
        return None
    return load_native()


class RuntimeBreakdown:
    """Timing wrappers around :data:`TARGETS`; ``install`` once, ``start`` at the first timed step."""

    def __init__(self) -> None:
        self.ns: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._recording = False
        self.installed: list[str] = []
        # the C++ copy bursts' own phase times (runtime/native/bursts.cpp), read when recording stops
        self.native_bursts: dict[str, Any] | None = None

    @property
    def recording(self) -> bool:
        return self._recording

    @recording.setter
    def recording(self, on: bool) -> None:
        """Start or stop timing; the C++ bursts' phase clock follows (its totals are kept when it stops)."""
        self._recording = on
        native = _native_module()
        if native is not None and hasattr(native, "burst_timing"):
            totals = native.burst_timing(on)
            if not on:
                self.native_bursts = totals

    def _wrap(self, fn: Any, label: str) -> Any:
        ns, calls = self.ns, self.calls

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self._recording:
                return fn(*args, **kwargs)
            t0 = perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[label] += perf_counter_ns() - t0
                calls[label] += 1

        return timed

    def install(self) -> None:
        # The points' forward glue and group hooks in C++ (runtime/native/points_block.cpp) call none of the Python
        # functions timed here: the breakdown times points.py's Python glue unless told otherwise (set before the
        # manager exists, which reads it once).
        os.environ.setdefault("MCORE_OFFLOAD_NATIVE_POINTS", "0")
        for module_name, path, *label in TARGETS:
            try:
                owner: Any = importlib.import_module(module_name)
            except ImportError:
                continue
            *parents, name = path.split(".")
            for p in parents:
                owner = getattr(owner, p, None)
            if owner is None or not hasattr(owner, name):
                continue
            raw = inspect.getattr_static(owner, name)  # through the bases: Function.apply is inherited
            tag = label[0] if label else path
            if isinstance(raw, staticmethod):
                setattr(owner, name, staticmethod(self._wrap(raw.__func__, tag)))
            elif isinstance(raw, classmethod):
                setattr(owner, name, staticmethod(self._wrap(getattr(owner, name), tag)))
            else:
                setattr(owner, name, self._wrap(raw, tag))
            self.installed.append(path)

    def wrapper_us(self, n: int = 20000) -> float:
        """Host cost of one wrapped call of an empty function, in microseconds."""
        probe = RuntimeBreakdown()
        probe._recording = True  # the wrappers only: the C++ bursts' clock is not this probe's
        f = probe._wrap(lambda: None, "probe")
        t0 = perf_counter_ns()
        for _ in range(n):
            f()
        return (perf_counter_ns() - t0) / n / 1e3

    def as_dict(self, steps: int) -> dict[str, Any]:
        rows = {
            label: {"us_per_step": round(self.ns[label] / steps / 1e3, 1),
                    "calls_per_step": round(self.calls[label] / steps, 1),
                    "us_per_call": round(self.ns[label] / max(self.calls[label], 1) / 1e3, 2)}
            for label, _ in self.ns.most_common()
        }
        out = {"steps": steps, "wrapper_us": round(self.wrapper_us(), 3), "functions": rows,
               # which points' glue ran (install() asks for the Python one unless the environment said otherwise)
               "native_points": os.environ.get("MCORE_OFFLOAD_NATIVE_POINTS", "1") != "0"}
        if self.native_bursts is not None:  # per burst and per copy, in µs (each phase once per burst)
            out["native_bursts"] = {
                direction: {"bursts_per_step": round(t["bursts"] / steps, 1),
                            "copies_per_burst": round(t["copies"] / max(t["bursts"], 1), 2),
                            "us_per_burst": {p: round(ns / max(t["bursts"], 1) / 1e3, 2) for p, ns in t["ns"].items()}}
                for direction, t in self.native_bursts.items()}
        return out
