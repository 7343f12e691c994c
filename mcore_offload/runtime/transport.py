"""Moving storages between the device and host memory.

One :class:`Transport` per device type: on CUDA, D2H and H2D run on two dedicated side streams and every
hand-off between streams is guarded by an event; on CPU (the test harness) copies are synchronous and the
"host" copy is simply a second CPU buffer, so the same handler logic runs in CI.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

logger = logging.getLogger(__name__)


class HostBufferPool:
    """Host buffers reused by exact size; pinned when the device is CUDA.

    A buffer handed back carries the event of the last copy that reads it; the next writer makes its
    stream wait on that event, so reuse never races an H2D still in flight and the host never blocks.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[tuple[torch.Tensor, object]]] = defaultdict(list)
        self.allocations = 0
        self.allocated_bytes = 0

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, object]:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        self.allocations += 1
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin), None

    def release(self, buf: torch.Tensor, last_read_event: object) -> None:
        self._free[buf.numel()].append((buf, last_read_event))

    def clear(self) -> None:
        self._free.clear()


class Transport:
    """Synchronous copies for CPU tensors (tests); subclassed for CUDA.

    Both directions work on batches (one offload flush, one group's reload plus its prefetch), so the
    per-batch costs (stream switch, cross-stream wait, event) are paid once per batch, not per storage.
    """

    def __init__(self) -> None:
        self.pool = HostBufferPool(pin=False)

    def to_host(self, storages: list[torch.UntypedStorage], keep_alive: list[torch.Tensor]) -> tuple[list, object]:
        """Copy each storage into a host buffer; return the buffers and one event for all the copies.

        ``keep_alive`` holds one tensor per storage: the allocator must not reuse its block before the copy.
        """
        bufs = []
        for storage in storages:
            buf, _ = self.pool.acquire(storage.nbytes())
            buf.untyped_storage().copy_(storage)
            bufs.append(buf)
        return bufs, None

    def to_device(self, hosts: list[torch.Tensor], after: list[object], device: torch.device):
        """Copy host buffers back into fresh device storages; return them and one event for all the copies.

        ``after``: the D2H events these reads must follow.
        """
        out = []
        for host in hosts:
            st = torch.UntypedStorage(host.numel(), device=device)
            st.copy_(host.untyped_storage())
            out.append(st)
        return out, None

    def wait(self, event: object) -> None:
        """Make the current (compute) stream wait for ``event``."""

    def release_host(self, buf: torch.Tensor, h2d_event: object) -> None:
        self.pool.release(buf, h2d_event)

    def synchronize(self) -> None:
        """Wait for every copy in flight (only on abort paths, never inside a step)."""


class CudaTransport(Transport):
    """D2H and H2D on their own streams, event-guarded in both directions."""

    def __init__(self, device: torch.device) -> None:
        self.pool = HostBufferPool(pin=True)
        self.device = device
        self.d2h_stream = torch.cuda.Stream(device=device)
        self.h2d_stream = torch.cuda.Stream(device=device)

    def _switch(self, stream: torch.cuda.Stream) -> torch.cuda.Stream:
        """Make ``stream`` current; return the compute stream it replaces (cheaper than the context manager)."""
        compute = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(stream)
        return compute

    def to_host(self, storages, keep_alive):
        compute = self._switch(self.d2h_stream)
        try:
            # The saved tensors were produced on the compute stream: copy only after it reached this point.
            self.d2h_stream.wait_stream(compute)
            bufs, waited = [], set()
            for storage, user in zip(storages, keep_alive):
                buf, reuse_event = self.pool.acquire(storage.nbytes())
                if reuse_event is not None and id(reuse_event) not in waited:
                    # The buffer's previous H2D must have read it before we overwrite it.
                    waited.add(id(reuse_event))
                    self.d2h_stream.wait_event(reuse_event)
                buf.untyped_storage().copy_(storage, non_blocking=True)
                # The caching allocator must not hand this block out before the copy has read it.
                user.record_stream(self.d2h_stream)
                bufs.append(buf)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        finally:
            torch.cuda.set_stream(compute)
        return bufs, done

    def to_device(self, hosts, after, device):
        # Allocated on the compute stream, which is the stream that consumes and later frees them.
        out = [torch.UntypedStorage(host.numel(), device=device) for host in hosts]
        compute = self._switch(self.h2d_stream)
        try:
            self.h2d_stream.wait_stream(compute)
            for event in {id(e): e for e in after if e is not None}.values():
                # A reload reads the host copy: its own D2H must have finished (upstream bug #7398).
                self.h2d_stream.wait_event(event)
            for st, host in zip(out, hosts):
                st.copy_(host.untyped_storage(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d_stream)
        finally:
            torch.cuda.set_stream(compute)
        return out, done

    def wait(self, event):
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self):
        self.d2h_stream.synchronize()
        self.h2d_stream.synchronize()


_TRANSPORTS: dict[torch.device, Transport] = {}


def transport_for(device: torch.device) -> Transport:
    """The shared transport of ``device`` (streams and pinned pool live as long as the process)."""
    t = _TRANSPORTS.get(device)
    if t is None:
        t = CudaTransport(device) if device.type == "cuda" else Transport()
        _TRANSPORTS[device] = t
    return t


def reset_transports() -> None:
    """Drop every stream and host buffer (tests; after an abort)."""
    for t in _TRANSPORTS.values():
        t.synchronize()
        t.pool.clear()
    _TRANSPORTS.clear()
