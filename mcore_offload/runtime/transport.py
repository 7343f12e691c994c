"""Moving storages between the device and host memory.

One :class:`Transport` per device type: on CUDA, D2H and H2D run on two dedicated side streams and every
hand-off between streams is guarded by an event; on CPU (the test harness) copies are synchronous and the
"host" copy is simply a second CPU buffer, so the same handler logic runs in CI. This module holds the interface,
the PyTorch-call CUDA transport and the per-device registry; the default CUDA transport, which makes the same calls
directly into the CUDA runtime, is ``raw_transport.RawCudaTransport``.
"""

from __future__ import annotations

import os
from collections import deque

import torch

from mcore_offload.runtime.cudart import load_runtime
from mcore_offload.runtime.host_pool import HostBufferPool
from mcore_offload.runtime.side_streams import make_side_streams
from mcore_offload.runtime.telemetry import LinkTelemetry

_raw_set_stream = getattr(torch._C, "_cuda_setStream", None)
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)  # (stream id, device index, type)
raw_current_stream_handle = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # the cudaStream_t


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


def part_ends(parts: list[int] | None, n: int) -> set[int]:
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


D2H_IN_FLIGHT_VARIABLE = "MCORE_OFFLOAD_D2H_IN_FLIGHT"


def d2h_in_flight_from_env() -> int:
    """``MCORE_OFFLOAD_D2H_IN_FLIGHT``: how many copy-out bursts a device may have in flight (0, the default: no
    bound; see :meth:`CudaTransport.bound_in_flight`). A bad value is one clear sentence."""
    raw = os.environ.get(D2H_IN_FLIGHT_VARIABLE, "0")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{D2H_IN_FLIGHT_VARIABLE}={raw!r} is not a non-negative integer; set N >= 1 to keep at "
                         "most N copy-out bursts in flight (the compute stream waits for the older ones), or unset "
                         "it (0) for no bound.")
    return value


FORWARD_END_VARIABLE = "MCORE_OFFLOAD_FORWARD_END"
FORWARD_END_CHOICES = ("hand-over", "wait")


def forward_end_from_env() -> str:
    """``MCORE_OFFLOAD_FORWARD_END``: what a chunk's forward end does with the copy-out bursts still running.
    ``hand-over`` (the default) gives their blocks to the allocator with ``record_stream``; ``wait`` makes the compute
    stream wait for them on the GPU, as ``MCORE_OFFLOAD_D2H_IN_FLIGHT`` does, without bounding the bursts in between
    (see :meth:`CudaTransport.release_copied`). Not the default: it cost B's attention set +2.1 % with no lower peak
    and lowered no peak on A's (session 85, 1× H200). A bad value is one clear sentence."""
    raw = os.environ.get(FORWARD_END_VARIABLE, "hand-over")
    if raw not in FORWARD_END_CHOICES:
        raise ValueError(f"{FORWARD_END_VARIABLE}={raw!r} is not one of {', '.join(FORWARD_END_CHOICES)}; set "
                         "wait to make the compute stream wait for the copies still running when a chunk's forward "
                         "ends, or unset it for hand-over.")
    return raw


class Transport:
    """Synchronous copies for CPU tensors (tests); subclassed for CUDA.

    Both directions work on batches (one offload flush; one group's reload with its prefetch), so the
    per-batch costs (a stream switch, a cross-stream wait, an event) are paid once per batch, not per
    storage: in a launch-bound step every microsecond of Python on this path is step time.
    """

    d2h_in_flight = 0  # MCORE_OFFLOAD_D2H_IN_FLIGHT (CudaTransport.bound_in_flight); 0: no bound
    in_flight_waits = 0  # the compute stream's waits for copy-out bursts under that bound (or at forward ends)
    # the bytes of the copy-out bursts those waits covered, all steps (runtime/host_ahead.py reads it per step: where
    # the compute stream had to wait for nearly all it copied out, the host saw no burst finish, i.e. ran ahead)
    bound_bytes = 0
    # MCORE_OFFLOAD_FORWARD_END=wait: at a forward's end the compute stream waits for the bursts still running instead
    # of handing their blocks to the allocator (as it does under any MCORE_OFFLOAD_D2H_IN_FLIGHT bound)
    wait_at_forward_end = False
    # what end_forward saw since the summary last took it (OffloadSummary.close_step): the chunk forwards that ended,
    # and the most bytes whose copy-out was still running at one of those ends (still allocated then, where the
    # step's peak usually comes)
    forward_ends = 0
    trailing_bytes = 0

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

    def release_copied(self, final: bool = False) -> int:
        """Let go of the device blocks whose copy to the host has finished (``final``: of all of them); return the
        bytes handed over while still being copied (none here: the copies are synchronous)."""
        return 0

    def end_forward(self) -> None:
        """A chunk's forward ended (the output layer and the loss, often the step's peak, come next): every copied
        block goes back to the allocator now (:meth:`release_copied` ``final``), and what was still being copied is
        counted (``trailing_bytes``)."""
        still_copying = self.release_copied(final=True)
        self.forward_ends += 1
        self.trailing_bytes = max(self.trailing_bytes, still_copying)

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
        self.d2h_in_flight = d2h_in_flight_from_env()
        self.wait_at_forward_end = forward_end_from_env() == "wait"

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
        if raw_current_stream_handle is not None:
            return raw_current_stream_handle(self.device_index)
        return self._current().cuda_stream

    def _done_event(self) -> torch.cuda.Event:
        """The event a burst's readers wait on; also the telemetry's end mark of the burst."""
        return torch.cuda.Event(enable_timing=self.telemetry.timed)

    def to_host(self, storages, keep_alive, routed):
        self.release_copied()
        self.bound_in_flight()
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
        ends = part_ends(parts, len(out))
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

    def wait(self, event, kind: str = "stall"):
        """The compute stream waits for ``event``; ``kind`` "bound" for a copy-out burst (telemetry's ``bound_ms``)."""
        if event is not None:
            compute = self._current()
            # The stall is how long after the compute stream reached this wait the awaited copy finished: one mark
            # here and the copy burst's own (timed) done event, instead of two marks around the wait.
            arrival = self.telemetry.mark(compute)
            compute.wait_event(event)
            self.telemetry.span(kind, arrival, event, keep_end=True)

    def bound_in_flight(self) -> None:
        """Before a copy-out burst, with ``MCORE_OFFLOAD_D2H_IN_FLIGHT=N``: if N bursts are still in flight, the
        compute stream waits (on the GPU: no host synchronisation) for the oldest ones, so that N remain with the new
        one, and their device blocks go back to the allocator now.

        Why: where the link cannot keep up with the forward, unbounded bursts keep every copied block on the device
        until its copy ends, and a peak inside the forward sees none of the offloaded bytes gone (session 57's
        local-spec run: 272 of 1304 MiB), and the blocks still being copied at a chunk's end go to the allocator
        with ``record_stream``, which then reserves new memory or, short of it, synchronises with the host.
        Bounded, the forward runs at the link's pace instead and the memory reserved follows the memory allocated
        (session 58: 3970 MiB reserved against 6652-7926 unbounded, at +4.5 % step time). Freed after the wait, a
        block is only reused by work the compute stream queues after it (the blocks were allocated on it), so no
        ``record_stream`` and no allocator event is needed. Called after :meth:`release_copied`, which has dropped
        the bursts seen complete.
        """
        limit = self.d2h_in_flight
        excess = len(self._held) - limit + 1 if limit else 0
        if excess > 0:
            self._wait_for_held(excess)

    def _wait_for_held(self, count: int) -> None:
        """The compute stream waits for the oldest ``count`` held bursts, which are then dropped (one D2H stream runs
        the bursts in order: waiting for the newest of them covers the older ones)."""
        held = self._held
        self.wait(held[count - 1][0], "bound")
        for _ in range(count):
            self.bound_bytes += sum(t.untyped_storage().nbytes() for t in held.popleft()[1])
        self.in_flight_waits += 1

    def release_copied(self, final=False):
        """Drop our references to the device blocks whose D2H burst has finished, oldest burst first; return the bytes
        of the blocks handed to the allocator still being copied (``final`` only).

        Why not ``record_stream``: with it, every free of a copied block records an allocator event, and every
        allocation while that event is pending queries it: tens of CUDA calls per layer in a launch-bound step
        (8-10 µs each), on top of the ones this runtime makes. Holding the tensors costs one query per burst,
        made at the next burst or reload; their blocks go back to the allocator then. ``final`` (a chunk's forward
        ended, a step ended): the bursts still in flight are handed to the allocator with ``record_stream``, as
        before, so their memory comes back as soon as the copy has read it, with no later poll needed. Under
        ``MCORE_OFFLOAD_D2H_IN_FLIGHT`` or ``MCORE_OFFLOAD_FORWARD_END=wait`` the compute stream waits for them
        instead (:meth:`bound_in_flight`): a pending allocator event makes the allocator synchronise with the host when
        memory runs short (session 57), and the allocator sees it complete only from the host, so a peak that comes
        soon after the forward's end still holds those blocks (session 83's A on a fast host); after a wait on the GPU
        they are reusable in stream order at once. Where the host runs ahead of the GPU (GPU-bound steps), it sees no
        burst complete during the forward either, and without the bound no block goes before the forward's end
        (session 84's B: Δpeak 750 of 1312 MiB unbounded, 1150 with ``MCORE_OFFLOAD_D2H_IN_FLIGHT=1``).
        """
        held = self._held
        while held and held[0][0].query():
            held.popleft()[0].seen_done = True  # reloads of these blocks need not wait on it (RawCudaTransport)
        if final and held:
            if self.d2h_in_flight or self.wait_at_forward_end:
                self._wait_for_held(len(held))  # the compute stream waits for them: nothing is handed over
                return 0
            stream = self.d2h_stream
            handed = 0
            for _, tensors in held:
                for t in tensors:
                    t.record_stream(stream)  # the allocator must not reuse the block before the copy read it
                    handed += t.untyped_storage().nbytes()
            held.clear()
            return handed  # at a forward's end (end_forward): still allocated at a peak that comes now
        return 0

    def synchronize(self):
        self.d2h_stream.synchronize()
        self.h2d_stream.synchronize()
        self._held.clear()


_TRANSPORTS: dict[torch.device, Transport] = {}


def transport_for(device: torch.device) -> Transport:
    """The shared transport of ``device`` (streams and pinned pool live as long as the process)."""
    t = _TRANSPORTS.get(device)
    if t is None:
        if device.type != "cuda":
            t = Transport()
        else:
            runtime = load_runtime()
            if runtime is None:
                t = CudaTransport(device)
            else:
                from mcore_offload.runtime.raw_transport import RawCudaTransport  # it subclasses CudaTransport

                t = RawCudaTransport(device, runtime)
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
