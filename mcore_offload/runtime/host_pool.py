"""Host buffers for offloaded storages, reused by size class so that no buffer is allocated after the first step.

Pinned (page-locked) on CUDA: the copy engines read and write it directly, which is what lets a copy run
asynchronously at the link's speed. Buffers are never freed during training (a pinned allocation costs about 0.1 s
for 256 MiB on the H100 host): :class:`HostBufferPool` hands them out by size class and takes them back with the
event of the last copy that read them.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable

import torch

from mcore_offload.config import choice_env


def size_class(nbytes: int) -> int:
    """The capacity a host buffer for ``nbytes`` gets: rounded up to 1/8 of its power of two (<12.5 % waste).

    Sizes of MoE activations move from step to step (FP8 pads each expert's tokens to a multiple of 16, and
    routing changes every step); rounding lets a buffer serve every nearby size, so the pool stops allocating.
    """
    granule = 1 << max(nbytes.bit_length() - 4, 9)
    return -(-nbytes // granule) * granule


class HostBufferPool:
    """Host buffers reused by size class (:func:`size_class`); pinned when the device is CUDA.

    ``acquire(n)`` hands out a uint8 tensor of exactly ``n`` bytes: the buffer itself, or its first ``n``
    bytes when the buffer is larger. A buffer handed back carries the event of the last copy that reads it;
    the next writer makes its stream wait on that event, so reuse never races an H2D still in flight and the
    host never blocks.

    Routed requests (MoE expert activations, keyed by their offload point) have sizes that follow the routing,
    which moves every step and, under expert parallelism, by far more than FP8 padding: buffers sized per
    request were outgrown until step 5 under EP=2 (seen on 2x H200). They get buffers of their own, one
    capacity per key: ``ROUTED_HEADROOM`` above a request that did not fit the previous one, and, at the end of
    a step in which it grew (:meth:`settle`), that much above the largest request seen, the key's smaller
    buffers replaced. Later steps find as many buffers as they hold at once, each fitting every size up to
    1.25x the first step's largest. How many a step holds may move too (SequentialMLP experts, each output under or
    over the size threshold): a key that runs short after the first step gets ``ROUTED_HEADROOM`` more buffers of
    its capacity at that step's end, once rather than one or two at a time.
    """

    #: a free buffer of a larger class is taken if it is at most this much larger than the request's class
    MAX_OVERSIZE = 1.25
    ROUTED_HEADROOM = 0.25

    def __init__(self, pin: bool, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self.pin = pin
        # how a new buffer is made (None: torch.empty, pinned if ``pin``); RawCudaTransport may pass write-combined
        self.allocate = allocate
        self._free: dict[int, list[tuple[torch.Tensor, object]]] = defaultdict(list)
        self._classes: list[int] = []  # sorted keys of _free
        self._routed_free: dict[str, list[tuple[torch.Tensor, object]]] = defaultdict(list)
        self._routed_cap: dict[str, int] = {}  # routed key -> the capacity its buffers get
        self._routed_largest: dict[str, int] = {}  # routed key -> the largest request seen
        self._routed_owner: dict[int, str] = {}  # data_ptr of a routed buffer -> its key
        self._routed_grew = False  # a routed capacity grew since the last settle()
        self._routed_short: set[str] = set()  # routed keys that ran out of buffers after the first step
        self._first_step_ended = False  # settle() ran once
        self._retired: list[tuple[torch.Tensor, object]] = []  # replaced buffers an H2D may still read
        self.allocations = 0
        self.allocated_bytes = 0

    def acquire(self, nbytes: int, routed: str | None = None) -> tuple[torch.Tensor, object]:
        """A buffer for ``nbytes`` and the event its next writer waits on (``routed``: see the class)."""
        buf, event = self.acquire_base(nbytes, routed)
        return (buf if buf.numel() == nbytes else buf[:nbytes]), event

    def acquire_base(self, nbytes: int, routed: str | None = None) -> tuple[torch.Tensor, object]:
        """:meth:`acquire` without the slice: the whole buffer, at least ``nbytes`` long (raw copies need only its
        address, and a slice is one more tensor op per storage on the hot path)."""
        if routed is not None:
            buf, event = self._acquire_routed(routed, nbytes)
        else:
            cap = size_class(nbytes)
            free = self._free.get(cap)
            if not free:
                free = None
                i = bisect.bisect_right(self._classes, cap)
                while i < len(self._classes) and self._classes[i] <= cap * self.MAX_OVERSIZE:
                    if self._free[self._classes[i]]:
                        free = self._free[self._classes[i]]
                        break
                    i += 1
            buf, event = free.pop() if free else (self._allocate(cap, None), None)
        return buf, event

    def _acquire_routed(self, key: str, nbytes: int) -> tuple[torch.Tensor, object]:
        if nbytes > self._routed_largest.get(key, 0):
            self._routed_largest[key] = nbytes
        free = self._routed_free[key]
        if free and free[-1][0].numel() >= nbytes:  # after the first step every buffer of the key fits
            return free.pop()
        fits = [i for i, (buf, _) in enumerate(free) if buf.numel() >= nbytes]
        if fits:
            return free.pop(min(fits, key=lambda i: free[i][0].numel()))
        cap = self._routed_cap.get(key, 0)
        if nbytes > cap:
            self._routed_cap[key] = cap = self._with_headroom(nbytes)
            self._routed_grew = True
        elif self._first_step_ended:
            self._routed_short.add(key)
        return self._allocate(cap, key), None

    def _with_headroom(self, nbytes: int) -> int:
        return size_class(int(nbytes * (1 + self.ROUTED_HEADROOM)))

    def _allocate(self, cap: int, routed: str | None) -> torch.Tensor:
        self.allocations += 1
        self.allocated_bytes += cap
        if self.allocate is not None:
            buf = self.allocate(cap)
        else:
            buf = torch.empty(cap, dtype=torch.uint8, pin_memory=self.pin)
        if routed is not None:
            self._routed_owner[buf.data_ptr()] = routed
        return buf

    def release(self, buf: torch.Tensor, last_read_event: object) -> None:
        base = buf if buf._base is None else buf._base
        key = self._routed_owner.get(base.data_ptr()) if self._routed_owner else None
        if key is not None:
            self._routed_free[key].append((base, last_read_event))
            return
        cls = base.numel()
        if cls not in self._free:
            bisect.insort(self._classes, cls)
        self._free[cls].append((base, last_read_event))

    def settle(self) -> None:
        """End of a step (every buffer is back): after a step in which a routed capacity grew (the first, then
        rarely), raise it to cover the largest request seen and replace the key's smaller buffers.

        The replacements count as that step's allocations. A replaced buffer may still be read by its last
        H2D: it is kept (retired) until that copy's event has completed, checked without blocking here.
        """
        self._retired = [(b, e) for b, e in self._retired if e is not None and not e.query()]
        self._first_step_ended = True
        # A key that needed more buffers at once than any step before: how many of its storages a step holds moves
        # with the routing too (SequentialMLP experts, each under or over the size threshold; 1-3 buffers at a time
        # in session 82's 80-step runs). It gets that headroom in count as well, once, instead of a few at a time.
        for key in self._routed_short:
            free = self._routed_free[key]
            cap = self._routed_cap[key]
            for _ in range(max(1, math.ceil(len(free) * self.ROUTED_HEADROOM))):
                free.insert(0, (self._allocate(cap, key), None))
        self._routed_short.clear()
        if not self._routed_grew:
            return
        self._routed_grew = False
        for key, free in self._routed_free.items():
            cap = self._routed_cap[key] = max(self._routed_cap.get(key, 0),
                                              self._with_headroom(self._routed_largest.get(key, 0)))
            for i, (buf, event) in enumerate(free):
                if buf.numel() < cap:
                    del self._routed_owner[buf.data_ptr()]
                    self.allocated_bytes -= buf.numel()
                    self._retired.append((buf, event))
                    free[i] = (self._allocate(cap, key), None)

    def clear(self) -> None:
        """Forget every buffer (callers synchronize the copy streams first)."""
        self._free.clear()
        self._classes.clear()
        self._routed_free.clear()
        self._routed_cap.clear()
        self._routed_largest.clear()
        self._routed_owner.clear()
        self._routed_grew = False
        self._routed_short.clear()
        self._first_step_ended = False
        self._retired.clear()


HOST_MEMORY_KINDS = ("pinned", "write-combined")


def host_memory_kind() -> str:
    """``MCORE_OFFLOAD_HOST_MEMORY``: how host buffers are allocated with raw copies (default ``pinned``)."""
    return choice_env("MCORE_OFFLOAD_HOST_MEMORY", "pinned", HOST_MEMORY_KINDS,
                      "a host memory kind: set it to 'pinned' (the default) or 'write-combined', or unset it")
