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


def storage_bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat ``uint8`` tensor over a whole storage (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat


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
    """Synchronous copies for CPU tensors (tests); subclassed for CUDA."""

    def __init__(self) -> None:
        self.pool = HostBufferPool(pin=False)

    def to_host(self, storages: list[torch.UntypedStorage]) -> list[tuple[torch.Tensor, object]]:
        """Copy each storage into a host buffer; return (buffer, done_event) pairs."""
        out = []
        for storage in storages:
            buf, _ = self.pool.acquire(storage.nbytes())
            buf.copy_(storage_bytes_view(storage))
            out.append((buf, None))
        return out

    def to_device(self, host: torch.Tensor, d2h_event: object, device: torch.device):
        """Copy a host buffer back into fresh device storage; return (storage, done_event)."""
        dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        dev.copy_(host)
        return dev.untyped_storage(), None

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

    def to_host(self, storages):
        compute = torch.cuda.current_stream(self.device)
        # The saved tensors were produced on the compute stream: copy only after it reached this point.
        self.d2h_stream.wait_stream(compute)
        out = []
        with torch.cuda.stream(self.d2h_stream):
            for storage in storages:
                buf, reuse_event = self.pool.acquire(storage.nbytes())
                if reuse_event is not None:
                    # The buffer's previous H2D must have read it before we overwrite it.
                    self.d2h_stream.wait_event(reuse_event)
                src = storage_bytes_view(storage)
                buf.copy_(src, non_blocking=True)
                # The caching allocator must not hand this block out before the copy has read it.
                src.record_stream(self.d2h_stream)
                out.append(buf)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        return [(buf, done) for buf in out]

    def to_device(self, host, d2h_event, device):
        compute = torch.cuda.current_stream(self.device)
        # Allocated on the compute stream, which is the stream that consumes and later frees it.
        dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        self.h2d_stream.wait_stream(compute)
        with torch.cuda.stream(self.h2d_stream):
            if d2h_event is not None:
                # A reload reads the host copy: its own D2H must have finished (upstream bug #7398).
                self.h2d_stream.wait_event(d2h_event)
            dev.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.h2d_stream)
        return dev.untyped_storage(), done

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
