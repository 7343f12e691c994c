"""The default CUDA transport: :class:`CudaTransport`'s hand-offs made as direct calls into the CUDA runtime.

Split from ``transport.py`` (one concept a file): that module holds the transport interface, the PyTorch-call CUDA
transport and the per-device registry (``transport_for``), which makes this one where the CUDA runtime loads.
"""

from __future__ import annotations

import functools
import logging

import torch

from mcore_offload.runtime.coalesce import CoalescedReloads, coalesce_reloads
from mcore_offload.runtime.cudart import (
    DEVICE_TO_HOST,
    HOST_ALLOC_WRITE_COMBINED,
    HOST_TO_DEVICE,
    CudaRuntime,
    EventPool,
    RawEvent,
    native_event_type,
)
from mcore_offload.runtime.host_pool import host_memory_kind
from mcore_offload.runtime.native import load_native
from mcore_offload.runtime.telemetry import LinkTelemetry
from mcore_offload.runtime.transport import CudaTransport, part_ends, raw_current_stream_handle

logger = logging.getLogger(__name__)


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

    # What the C++ bursts read and write (about 30 times a layer-microbatch) as slots, one load each
    # (native/member_slots.cpp); the rest in the instance dict (``coalesce`` and ``_last_h2d_done`` too: their class
    # defaults in CoalescedReloads are what a transport that never set them reads)
    __slots__ = ("rt", "reload_seq", "native", "telemetry", "_held", "_timed_events", "_waited_seq", "_h2d_fence",
                 "_h2d_handle", "device_index", "_d2h_fence", "_d2h_handle", "pool")

    def __init__(self, device: torch.device, runtime: CudaRuntime) -> None:
        super().__init__(device)
        self.rt = runtime
        self._memcpy = runtime.memcpy_async
        # the C++ copy loop and reload allocations (runtime/native), or None: the Python ones (MCORE_OFFLOAD_NATIVE)
        self.native = load_native()
        self._timed_events = EventPool(runtime, self.device_index, timed=True)
        if self.native is not None:  # done events and marks without a Python constructor and finaliser
            self._timed_events.event_type = native_event_type(self.native)
        self.telemetry = LinkTelemetry(self._timed_events.get)
        self._d2h_fence = EventPool(runtime, self.device_index, timed=False).get()
        self._h2d_fence = EventPool(runtime, self.device_index, timed=False).get()
        self._d2h_handle = self.d2h_stream.cuda_stream
        self._h2d_handle = self.h2d_stream.cuda_stream
        self.coalesce = coalesce_reloads()
        if raw_current_stream_handle is not None:  # a C call with no Python frame (the C++ bursts call it too)
            self._compute_handle = functools.partial(raw_current_stream_handle, self.device_index)
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

    #: False: the Python methods below make every burst and wait even where the C++ ones could (for comparisons)
    cpp_bursts = True

    def _native_bursts(self):
        """The C++ bursts (runtime/native/bursts.cpp), or None: where the reloads are coalesced, copies go as one
        cudaMemcpyBatchAsync, or the runtime has no C entry points (tests' fakes), the Python methods below make
        them. The C++ copy-out, reload and wait paths read the same conditions (link_calls.cpp: bursts_in_cpp)."""
        native = self.native
        rt = self.rt
        if not self.cpp_bursts or native is None or self.coalesce or rt.memcpy_batch is not None:
            return None
        if getattr(rt, "call_addresses", None) is None:
            return None
        return native

    def release_copied(self, final=False):
        native = None if final else self._native_bursts()
        if native is not None:
            native.release_copied(self)
            return 0
        return super().release_copied(final)

    def to_host(self, storages, keep_alive, routed):
        native = self._native_bursts()
        if native is not None:  # the same calls, in the same order, in one C++ call
            return native.to_host_burst(self, storages, keep_alive, routed)
        self.release_copied()
        self.bound_in_flight()
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
        ends = sorted(part_ends(parts, len(hosts))) if parts else [len(hosts)]
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

    def wait(self, event, kind="stall"):
        if event is not None:
            compute = self._compute_handle()
            arrival = self.telemetry.mark(compute)  # see CudaTransport.wait
            err = self.rt.stream_wait(compute, event.handle, 0)
            if err:
                self.rt.fail("cudaStreamWaitEvent", err)
            self.telemetry.span(kind, arrival, event, keep_end=True)
