"""Moving storages between the device and host memory.

One :class:`Transport` per device type: on CUDA, D2H and H2D run on two dedicated side streams and every
hand-off between streams is guarded by an event; on CPU (the test harness) copies are synchronous and the
"host" copy is simply a second CPU buffer, so the same handler logic runs in CI.
"""

from __future__ import annotations

import functools
import logging
from collections import deque

import torch

from mcore_offload.runtime.coalesce import CoalescedReloads, coalesce_reloads
from mcore_offload.runtime.cudart import (
    DEVICE_TO_HOST,
    HOST_ALLOC_WRITE_COMBINED,
    HOST_TO_DEVICE,
    CudaRuntime,
    EventPool,
    RawEvent,
    load_runtime,
)
from mcore_offload.runtime.host_pool import HostBufferPool, host_memory_kind
from mcore_offload.runtime.native import load_native
from mcore_offload.runtime.side_streams import make_side_streams
from mcore_offload.runtime.telemetry import LinkTelemetry

logger = logging.getLogger(__name__)


_raw_set_stream = getattr(torch._C, "_cuda_setStream", None)
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)  # (stream id, device index, type)
_raw_current_stream_handle = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the cudaStream_t


def _set_stream(stream: torch.cuda.Stream) -> None:
    if _raw_set_stream is None:  # private API gone
        torch.cuda.set_stream(stream)
    else:
        _raw_set_stream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole ``storage`` (for copies into or out of part of a larger buffer)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def copy_into_host(buf: torch.Tensor, storage: torch.UntypedStorage, non_blocking: bool = False) -> None:
    if buf._base is None:  # the buffer is exactly the storage's size: the cheaper storage copy
        buf.untyped_storage().copy_(storage, non_blocking=non_blocking)
    else:
        buf.copy_(as_bytes(storage), non_blocking=non_blocking)


def _part_ends(parts: list[int] | None, n: int) -> set[int]:
    """The copy counts after which a part of an ``n``-copy burst ends (``parts``: see :meth:`Transport.to_device`)."""
    if not parts:
        return {n}
    ends, total = set(), 0
    for p in parts:
        total += p
        ends.add(total)
    if total != n or 0 in ends:
        raise ValueError(f"reload parts {parts} do not split {n} copies into non-empty runs")
    return ends


class Transport:
    """Synchronous copies for CPU tensors (tests); subclassed for CUDA.

    Both directions work on batches (one offload flush; one group's reload with its prefetch), so the
    per-batch costs (a stream switch, a cross-stream wait, an event) are paid once per batch, not per
    storage: in a launch-bound step every microsecond of Python on this path is step time.
    """

    def __init__(self) -> None:
        self.pool = HostBufferPool(pin=False)
        self.telemetry = LinkTelemetry(None)
        self.reload_seq = 0  # reload bursts started (the handlers number them: wait_reload)
        self._waited_seq: dict[int, int] = {}  # compute stream -> the latest reload burst it waited for

    def to_host(self, storages: list[torch.UntypedStorage], keep_alive: list[torch.Tensor],
                routed: list[str | None]) -> tuple[list, object]:
        """Copy each storage into a host buffer; return the buffers and one event for all the copies.

        ``keep_alive`` holds one tensor per storage: the allocator must not reuse its block before the copy.
        ``routed``: per storage, the offload point if its size follows MoE routing, else None
        (:attr:`HostBufferPool.ROUTED_HEADROOM`).
        """
        bufs = []
        for storage, r in zip(storages, routed):
            buf, _ = self.pool.acquire(storage.nbytes(), r)
            copy_into_host(buf, storage)
            bufs.append(buf)
        self.telemetry.span("d2h", None, None, sum(s.nbytes() for s in storages))
        return bufs, None

    def to_device(self, hosts: list[torch.Tensor], sizes: list[int], after: list[object], device: torch.device,
                  parts: list[int] | None = None) -> tuple[list, list]:
        """Copy the first ``sizes[i]`` bytes of each host buffer into a fresh device storage, in order; return them
        and one done event per part (``parts``: how many consecutive copies each part holds; None: one part).
        ``after``: the D2H events these reads must follow.

        Why parts: a burst that brings back several layers costs the fixed per-burst calls once, and the layer
        needed first waits only for its own copies (its part's event), not for the whole burst's.
        """
        out = []
        for host, n in zip(hosts, sizes):
            dst = torch.empty(n, dtype=torch.uint8, device=device)
            dst.copy_(host if host.numel() == n else host[:n])
            out.append(dst.untyped_storage())
        self.telemetry.span("h2d", None, None, sum(sizes))
        return out, [None] * (len(parts) if parts else 1)

    def wait(self, event: object) -> None:
        """Make the current (compute) stream wait for ``event``."""

    def _compute_handle(self) -> int:
        """The current (compute) stream's raw handle (0 on the CPU)."""
        return 0

    def wait_reload(self, event: object, seq: int) -> None:
        """Make the compute stream wait for reload burst number ``seq`` (its done ``event``), unless it already waited
        for that burst or a later one: reloads run in order on one stream, so a wait covers every earlier burst (a
        burst spanning several layers is then waited for once, not at each layer)."""
        stream = self._compute_handle()
        if self._waited_seq.get(stream, 0) >= seq:
            return
        self._waited_seq[stream] = seq
        self.wait(event)

    def release_copied(self, final: bool = False) -> None:
        """Let go of the device blocks whose copy to the host has finished (``final``: of all of them)."""

    def release_host(self, buf: torch.Tensor, h2d_event: object) -> None:
        self.pool.release(buf, h2d_event)

    def returns_to_pool(self) -> bool:
        """Whether :meth:`release_host` is the pool's release (the C++ finish then hands buffers back itself)."""
        return type(self).release_host is Transport.release_host

    def synchronize(self) -> None:
        """Wait for every copy in flight (only on abort paths, never inside a step)."""


class CudaTransport(Transport):
    """D2H and H2D on their own streams, event-guarded in both directions, timed for telemetry, through PyTorch's
    copies and events: the fallback where the CUDA runtime library cannot be called directly
    (:class:`RawCudaTransport`, the default, does the same through it).

    Every call here runs once per copy burst on a launch-bound hot path, so the per-burst Python is kept to
    raw stream lookups and reused fence events: ``torch.cuda.current_stream`` builds a Stream object and
    ``Stream.wait_stream`` creates an event each call, and both cost more than the copy launches.
    """

    _memcpy = None  # the raw copy entry point (RawCudaTransport); tests read which path ran

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.pool = HostBufferPool(pin=True)
        self.device = device
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.d2h_stream, self.h2d_stream = make_side_streams(device)  # MCORE_OFFLOAD_SIDE_STREAMS
        self.telemetry = LinkTelemetry(self._timing_event)
        # Recorded on the compute stream and waited on by a side stream right away: a wait binds to the
        # record before it, so one event per direction serves every burst.
        self._d2h_fence = torch.cuda.Event()
        self._h2d_fence = torch.cuda.Event()
        self._streams: dict[int, torch.cuda.Stream] = {}  # stream id -> Stream object, for the raw lookup
        # (done event, the device tensors it read) per D2H burst, oldest first: see release_copied
        self._held: deque[tuple[object, list[torch.Tensor]]] = deque()

    @staticmethod
    def _timing_event() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def _current(self) -> torch.cuda.Stream:
        """The current (compute) stream, from a cache keyed by the raw stream id."""
        if _raw_current_stream is None:  # private API gone
            return torch.cuda.current_stream(self.device_index)
        sid = _raw_current_stream(self.device_index)[0]
        stream = self._streams.get(sid)
        if stream is None:
            stream = self._streams[sid] = torch.cuda.current_stream(self.device_index)
        return stream

    def _compute_handle(self) -> int:
        if _raw_current_stream_handle is not None:
            return _raw_current_stream_handle(self.device_index)
        return self._current().cuda_stream

    def _done_event(self) -> torch.cuda.Event:
        """The event a burst's readers wait on; also the telemetry's end mark of the burst."""
        return torch.cuda.Event(enable_timing=self.telemetry.timed)

    def to_host(self, storages, keep_alive, routed):
        self.release_copied()
        d2h = self.d2h_stream
        compute = self._current()
        # The saved tensors were produced on the compute stream: copy only after it reached this point.
        self._d2h_fence.record(compute)
        d2h.wait_event(self._d2h_fence)
        bufs = []
        waited = None
        nbytes = 0
        for storage, r in zip(storages, routed):
            n = storage.nbytes()
            nbytes += n
            buf, event = self.pool.acquire(n, r)
            if event is not None and event is not waited:
                # A reused buffer's previous H2D must have read it before we overwrite it (consecutive
                # buffers mostly share one reload batch's event: waiting once is enough).
                d2h.wait_event(event)
                waited = event
            bufs.append(buf)
        start = self.telemetry.mark(d2h)
        _set_stream(d2h)
        try:
            for storage, buf in zip(storages, bufs):
                copy_into_host(buf, storage, non_blocking=True)
        finally:
            _set_stream(compute)
        done = self._done_event()
        done.record(d2h)
        self._held.append((done, keep_alive))
        self.telemetry.span("d2h", start, done, nbytes, keep_end=True)
        return bufs, done

    def to_device(self, hosts, sizes, after, device, parts=None):
        self.release_copied()
        h2d = self.h2d_stream
        # Allocated on the compute stream, which is the stream that consumes and later frees them. Byte tensors,
        # not bare storages: a tensor-to-tensor copy costs less host time than storage.copy_.
        out = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        compute = self._current()
        # The new blocks may be memory the compute stream has just freed and still reads.
        self._h2d_fence.record(compute)
        h2d.wait_event(self._h2d_fence)
        waited = None
        for event in after:
            if event is not None and event is not waited:
                # A reload reads the host copy: its own D2H must have finished (upstream bug #7398).
                h2d.wait_event(event)
                waited = event
        start = self.telemetry.mark(h2d)
        ends = _part_ends(parts, len(out))
        events = []
        _set_stream(h2d)
        try:
            for i, (dst, host, n) in enumerate(zip(out, hosts, sizes)):
                dst.copy_(host if host.numel() == n else host[:n], non_blocking=True)
                if i + 1 in ends:
                    events.append(self._done_event())
                    events[-1].record(h2d)
        finally:
            _set_stream(compute)
        self.telemetry.span("h2d", start, events[-1], sum(sizes), keep_end=True)
        return [dst.untyped_storage() for dst in out], events

    def wait(self, event):
        if event is not None:
            compute = self._current()
            # The stall is how long after the compute stream reached this wait the awaited copy finished: one mark
            # here and the copy burst's own (timed) done event, instead of two marks around the wait.
            arrival = self.telemetry.mark(compute)
            compute.wait_event(event)
            self.telemetry.span("stall", arrival, event, keep_end=True)

    def release_copied(self, final=False):
        """Drop our references to the device blocks whose D2H burst has finished, oldest burst first.

        Why not ``record_stream``: with it, every free of a copied block records an allocator event, and every
        allocation while that event is pending queries it: tens of CUDA calls per layer in a launch-bound step
        (8-10 µs each), on top of the ones this runtime makes. Holding the tensors costs one query per burst,
        made at the next burst or reload; their blocks go back to the allocator then. ``final`` (a chunk's forward
        ended, a step ended): the bursts still in flight are handed to the allocator with ``record_stream``, as
        before, so their memory comes back as soon as the copy has read it, with no later poll needed.
        """
        held = self._held
        while held and held[0][0].query():
            held.popleft()[0].seen_done = True  # reloads of these blocks need not wait on it (RawCudaTransport)
        if final and held:
            stream = self.d2h_stream
            for _, tensors in held:
                for t in tensors:
                    t.record_stream(stream)  # the allocator must not reuse the block before the copy read it
            held.clear()

    def synchronize(self):
        self.d2h_stream.synchronize()
        self.h2d_stream.synchronize()
        self._held.clear()


class RawCudaTransport(CoalescedReloads, CudaTransport):
    """:class:`CudaTransport` with every copy, event record and cross-stream wait a direct call into the CUDA
    runtime PyTorch has loaded (:class:`~mcore_offload.runtime.cudart.CudaRuntime`), on raw stream handles.

    The same hand-offs, each guarded by an event: the side stream waits for the compute stream before reading a
    saved storage or writing a new block; an H2D waits for the D2H that filled its buffer; a reused host buffer
    waits for the H2D that last read it (implied, and not made, where the compute stream already waited for that
    reload: tests/test_stream_order.py checks every hand-off from the calls); the compute stream waits for a reload
    before its first reader. Host buffers travel whole (no slice tensor): a burst needs only addresses and sizes.
    With ``MCORE_OFFLOAD_COALESCE_RELOADS=1`` a burst shares one buffer, in slices, and a group comes back with one
    copy (:class:`~mcore_offload.runtime.coalesce.CoalescedReloads`).
    """

    def __init__(self, device: torch.device, runtime: CudaRuntime) -> None:
        super().__init__(device)
        self.rt = runtime
        self._memcpy = runtime.memcpy_async
        self._timed_events = EventPool(runtime, self.device_index, timed=True)
        self.telemetry = LinkTelemetry(self._timed_events.get)
        self._d2h_fence = EventPool(runtime, self.device_index, timed=False).get()
        self._h2d_fence = EventPool(runtime, self.device_index, timed=False).get()
        self._d2h_handle = self.d2h_stream.cuda_stream
        self._h2d_handle = self.h2d_stream.cuda_stream
        # the C++ copy loop and reload allocations (runtime/native), or None: the Python ones (MCORE_OFFLOAD_NATIVE)
        self.native = load_native()
        self.coalesce = coalesce_reloads()
        if _raw_current_stream_handle is not None:  # a C call with no Python frame (the C++ bursts call it too)
            self._compute_handle = functools.partial(_raw_current_stream_handle, self.device_index)
        self._slices_left: dict[int, int] = {}  # coalesced host buffer (address) -> its slices not yet released
        if runtime.memcpy_batch is not None and not self._batch_copy_works():
            runtime.memcpy_batch = None
        if host_memory_kind() == "write-combined":
            # The CPU never reads these buffers (only the copy engines do); write-combined memory is not snooped in
            # the CPU's caches during PCIe transfers.
            self.pool.allocate = lambda n: runtime.host_tensor(n, HOST_ALLOC_WRITE_COMBINED)

    def _batch_copy_works(self) -> bool:
        """Check ``cudaMemcpyBatchAsync`` once, on this device, before any burst relies on it (a copy of known bytes
        out and back in; synchronous, at construction only)."""
        src = torch.arange(64, dtype=torch.uint8, device=self.device)
        host = [torch.zeros(32, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        err = self.rt.memcpy_many([h.data_ptr() for h in host], [src.data_ptr(), src.data_ptr() + 32], [32, 32],
                                  self._d2h_handle)
        self.d2h_stream.synchronize()
        ok = not err and torch.equal(torch.cat(host), src.cpu())
        if not ok:
            logger.info("cudaMemcpyBatchAsync did not copy correctly here (%s): bursts copy storage by storage",
                        self.rt.error_string(err) if err else "wrong bytes")
        return ok

    def _done_event(self) -> RawEvent:
        """The event a burst's readers wait on; also the telemetry's end mark (always timed here: a timed event
        records and is waited on like any other, and one pool serves marks and done events)."""
        return self._timed_events.get()

    def _native_bursts(self):
        """The C++ bursts (runtime/native/bursts.cpp), or None: where the reloads are coalesced, copies go as one
        cudaMemcpyBatchAsync, or the runtime has no C entry points (tests' fakes), the Python methods below make
        them."""
        native = self.native
        rt = self.rt
        if native is None or self.coalesce or rt.memcpy_batch is not None:
            return None
        if getattr(rt, "call_addresses", None) is None:
            return None
        return native

    def release_copied(self, final=False):
        native = None if final else self._native_bursts()
        if native is not None:
            native.release_copied(self)
        else:
            super().release_copied(final)

    def to_host(self, storages, keep_alive, routed):
        native = self._native_bursts()
        if native is not None:  # the same calls, in the same order, in one C++ call
            return native.to_host_burst(self, storages, keep_alive, routed)
        self.release_copied()
        rt = self.rt
        record, stream_wait = rt.event_record, rt.stream_wait
        d2h = self._d2h_handle
        fence = self._d2h_fence.handle
        compute = self._compute_handle()
        # The saved tensors were produced on the compute stream: copy only after it reached this point.
        err = record(fence, compute) or stream_wait(d2h, fence, 0)
        sizes = [storage.nbytes() for storage in storages]
        nbytes = sum(sizes)
        if self.coalesce and self.native is not None:
            bufs, events = self._acquire_coalesced(sizes, routed)
        else:
            acquire = self.pool.acquire_base
            bufs, events = [], []
            for n, r in zip(sizes, routed):
                buf, event = acquire(n, r)
                bufs.append(buf)
                events.append(event)
        waited = None
        # A reused buffer's previous H2D must have read it before we overwrite it. Where the compute stream has
        # already waited for that reload burst or a later one (wait_reload; one H2D stream runs the bursts in
        # order), the fence above, recorded on that stream after its wait, orders this copy after the H2D: no
        # call needed (about one a group otherwise).
        ordered = self._waited_seq.get(compute, 0)
        for event in events:
            if event is not None and event is not waited and (event.reload_seq is None or event.reload_seq > ordered):
                err = err or stream_wait(d2h, event.handle, 0)
                waited = event
        if err:
            rt.fail("cudaEventRecord/cudaStreamWaitEvent", err)
        start = self.telemetry.mark(d2h)
        done = self._copy_burst(bufs, storages, sizes, DEVICE_TO_HOST, d2h)
        # The caching allocator must not hand these blocks out before the copy has read them (release_copied).
        self._held.append((done, keep_alive))
        self.telemetry.span("d2h", start, done, nbytes, keep_end=True)
        return bufs, done

    def to_device(self, hosts, sizes, after, device, parts=None):
        native = self._native_bursts()
        if native is not None:  # the same calls, in the same order, in one C++ call (storages on self.device_index)
            return native.to_device_burst(self, hosts, sizes, after, parts)
        self.release_copied()
        rt = self.rt
        record, stream_wait = rt.event_record, rt.stream_wait
        h2d = self._h2d_handle
        ends = sorted(_part_ends(parts, len(hosts))) if parts else [len(hosts)]
        # Allocated on the compute stream, which is the stream that consumes and later frees them.
        copies = None  # per part: the (device blocks, host sources, sizes) of its copies, where coalesced
        if self.coalesce and self.native is not None:
            out, copies = self._coalesced_layout(hosts, sizes, ends)
        elif self.native is not None:
            out = self.native.empty_storages(sizes, self.device_index)
        else:
            # a storage, not torch.empty: no deterministic-mode fill of memory the copy overwrites (common.h)
            out = [torch.UntypedStorage(n, device=device) for n in sizes]
        fence = self._h2d_fence.handle
        # The new blocks may be memory the compute stream has just freed and still reads.
        err = record(fence, self._compute_handle()) or stream_wait(h2d, fence, 0)
        waited = None
        for event in after:
            if event is not None and event is not waited and not event.seen_done:
                # A reload reads the host copy: its own D2H must have finished (upstream bug #7398). A D2H
                # already seen complete (release_copied) needs no wait: one CUDA call less per reload burst.
                err = err or stream_wait(h2d, event.handle, 0)
                waited = event
        if err:
            rt.fail("cudaEventRecord/cudaStreamWaitEvent", err)
        start = self.telemetry.mark(h2d)
        events, first = [], 0
        for p, end in enumerate(ends):
            if copies is not None:
                events.append(self._copy_burst(*copies[p], HOST_TO_DEVICE, h2d))
            else:
                events.append(self._copy_burst(out[first:end], hosts[first:end], sizes[first:end], HOST_TO_DEVICE,
                                               h2d))
            # The number the handler gives this part right after (reload_seq + 1 per part, in order: wait_reload),
            # for to_host's reuse check. Were it not given (a failed reload), a later burst takes the same number:
            # a later burst on this stream, so waiting for it still covers this one.
            events[-1].reload_seq = self.reload_seq + 1 + p
            first = end
        self._last_h2d_done = events[-1]
        self.telemetry.span("h2d", start, events[-1], sum(sizes), keep_end=True)
        return out, events

    def _copy_burst(self, dsts: list, srcs: list, sizes: list[int], kind: int, stream: int) -> RawEvent:
        """Copy the first ``sizes[i]`` bytes of ``srcs[i]`` to ``dsts[i]`` (tensors or storages) on ``stream``, then
        record a done event there and return it."""
        rt = self.rt
        if rt.memcpy_batch is not None and len(dsts) > 1:  # one call for the burst
            err = rt.memcpy_many([d.data_ptr() for d in dsts], [s.data_ptr() for s in srcs], sizes, stream)
            if err:
                rt.fail("cudaMemcpyBatchAsync", err)
        elif self.native is not None:  # the same loop in C++
            err = self.native.copy_burst(rt.memcpy_address, dsts, srcs, sizes, kind, stream)
            if err:
                rt.fail("cudaMemcpyAsync", err)
        else:
            memcpy = rt.memcpy
            for dst, src, n in zip(dsts, srcs, sizes):
                err = memcpy(dst.data_ptr(), src.data_ptr(), n, kind, stream)
                if err:
                    rt.fail("cudaMemcpyAsync", err)
        done = self._done_event()
        err = rt.event_record(done.handle, stream)
        if err:
            rt.fail("cudaEventRecord", err)
        return done

    def wait(self, event):
        if event is not None:
            compute = self._compute_handle()
            arrival = self.telemetry.mark(compute)  # see CudaTransport.wait
            err = self.rt.stream_wait(compute, event.handle, 0)
            if err:
                self.rt.fail("cudaStreamWaitEvent", err)
            self.telemetry.span("stall", arrival, event, keep_end=True)


_TRANSPORTS: dict[torch.device, Transport] = {}


def transport_for(device: torch.device) -> Transport:
    """The shared transport of ``device`` (streams and pinned pool live as long as the process)."""
    t = _TRANSPORTS.get(device)
    if t is None:
        if device.type != "cuda":
            t = Transport()
        else:
            runtime = load_runtime()
            t = CudaTransport(device) if runtime is None else RawCudaTransport(device, runtime)
        _TRANSPORTS[device] = t
    return t


def settle_pools() -> None:
    """End of a step: hand every copied device block back (:meth:`Transport.release_copied`) and let each host pool
    settle (:meth:`HostBufferPool.settle`)."""
    for t in _TRANSPORTS.values():
        t.release_copied(final=True)
        t.pool.settle()


def live_transports() -> list[Transport]:
    """Every device's transport made so far (the summary reads their pools and telemetry)."""
    return list(_TRANSPORTS.values())


def release_host_buffers() -> None:
    """Wait for every copy in flight, then free every transport's host buffers (between steps only)."""
    for t in _TRANSPORTS.values():
        t.synchronize()
        t.pool.clear()


def reset_transports() -> None:
    """Drop every stream and host buffer (tests; after an abort)."""
    release_host_buffers()
    _TRANSPORTS.clear()
