"""Raw ``cudaMemcpyAsync`` and CUDA events through the CUDA runtime library that PyTorch itself has loaded.

Why: inside a launch-bound training step a ``Tensor.copy_`` / ``UntypedStorage.copy_`` between a device storage
and a pinned buffer costs 30-35 µs of host time (dispatcher, TensorIterator, a device guard, and an event that
PyTorch's pinned-memory allocator records for every non-blocking copy), measured in session 6; the runtime
issues one per offloaded storage, twice per step. The copy itself needs two addresses, a size and a stream.

Only the library already mapped into this process is used (never a second copy found on disk): its streams
and context are PyTorch's. Where it is not found (a CPU build, a static link, another platform),
:func:`load_runtime` answers None and the transport keeps PyTorch's copies and events. ``MCORE_OFFLOAD_RAW_COPY=0``
turns the raw path off.

Safety is the caller's: the source and destination must stay allocated until the copy has run (the transport
holds a copied device block until its burst's event is seen complete, and keeps host buffers until a later event says
they were read).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: ``cudaMemcpyKind``
HOST_TO_DEVICE = 1
DEVICE_TO_HOST = 2
CUDA_ERROR_NOT_READY = 600  # cudaErrorNotReady: cudaEventQuery's "not yet"
EVENT_BLOCKING_SYNC = 1  # cudaEventBlockingSync: a synchronize on it sleeps instead of spinning a core
EVENT_DISABLE_TIMING = 2  # cudaEventDisableTiming
HOST_ALLOC_WRITE_COMBINED = 4  # cudaHostAllocWriteCombined

MemcpyAsync = Callable[[int, int, int, int, int], None]
MEMCPY_SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream: sources are read in stream order
BATCH_COPY_MIN_VERSION = 13000  # CUDA 12.8-12.9 have cudaMemcpyBatchAsync with one more argument (failIdx)


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``struct cudaMemcpyAttributes`` (CUDA 13 ``driver_types.h``)."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", MemLocation), ("dst_loc_hint", MemLocation),
                ("flags", ctypes.c_uint)]


#: cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream), CUDA 13
BATCH_ARGTYPES = (ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
                  ctypes.c_size_t, ctypes.POINTER(MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t,
                  ctypes.c_void_p)


def mapped_cudart(maps_text: str) -> str | None:
    """The path of the ``libcudart.so*`` mapped in a process, from the text of its ``/proc/<pid>/maps``."""
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6:
            path = parts[5].strip()
            if os.path.basename(path).startswith("libcudart.so"):
                return path
    return None


class EventCalls:
    """The part of ``torch.cuda.Event``'s interface the runtime uses, on a ``cudaEvent_t`` of the mapped runtime
    (``handle``, ``_rt``; ``record(stream)`` takes a raw ``cudaStream_t``): shared by :class:`RawEvent` and the C++
    module's event type (:func:`native_event_type`)."""

    __slots__ = ()
    handle: int
    _rt: CudaRuntime

    def record(self, stream: int) -> None:
        err = self._rt.event_record(self.handle, stream)
        if err:
            self._rt.fail("cudaEventRecord", err)

    def query(self) -> bool:
        err = self._rt.event_query(self.handle)
        if err == CUDA_ERROR_NOT_READY:
            return False
        if err:
            self._rt.fail("cudaEventQuery", err)
        return True

    def synchronize(self) -> None:
        err = self._rt.event_synchronize(self.handle)
        if err:
            self._rt.fail("cudaEventSynchronize", err)

    def elapsed_time(self, end: EventCalls) -> float:
        """Milliseconds from this event to ``end`` (both timed and complete)."""
        ms = ctypes.c_float()
        err = self._rt.event_elapsed(ctypes.byref(ms), self.handle, end.handle)
        if err:
            self._rt.fail("cudaEventElapsedTime", err)
        return ms.value


class RawEvent(EventCalls):
    """A ``cudaEvent_t`` of the mapped runtime (:class:`EventCalls`). When the last Python reference goes, the handle
    returns to the free list it came from: no wait can be enqueued on it any more, and a wait already enqueued stays
    bound to the record it saw (CUDA's rule), so recording it again later is safe."""

    __slots__ = ("handle", "_rt", "_free", "seen_done", "reload_seq")

    def __init__(self, rt: CudaRuntime, handle: int, free: list[int]) -> None:
        self.handle, self._rt, self._free = handle, rt, free
        # a query answered complete for this record (set by the transport): a stream waiting on it may skip the
        # wait. Per object: a recycled handle comes back in a new RawEvent, unseen.
        self.seen_done = False
        # the reload burst (part) this event ends, as the handler numbers them (Transport.wait_reload); None: not one
        self.reload_seq: int | None = None

    def __del__(self) -> None:
        self._free.append(self.handle)


def native_event_type(native: Any) -> type:
    """:class:`RawEvent` with its fields, constructor and finaliser in C++ (``native.RawEventBase``, event_type.cpp):
    made and dropped two or three times a layer-microbatch, without a Python frame. One class per loaded module."""
    made = getattr(native, "RawEvent", None)
    if made is None:
        made = type("RawEvent", (native.RawEventBase, EventCalls), {"__slots__": (), "__doc__": RawEvent.__doc__})
        native.RawEvent = made
    return made


class EventPool:
    """The events of one device: created on first need (with that device current), recycled after that."""

    def __init__(self, rt: CudaRuntime, device_index: int, timed: bool, blocking: bool = False) -> None:
        self.rt, self.device_index, self.timed = rt, device_index, timed
        self.flags = (0 if timed else EVENT_DISABLE_TIMING) | (EVENT_BLOCKING_SYNC if blocking else 0)
        self.free: list[int] = []
        self.created = 0
        #: the class of the events handed out, called as (runtime, handle, free list); the C++ bursts make theirs the
        #: same way from a free handle (runtime/native/link_calls.cpp: done_event)
        self.event_type: type = RawEvent

    def get(self) -> RawEvent:
        free = self.free
        if free:
            return self.event_type(self.rt, free.pop(), free)
        import torch  # only here: this module is imported on CPU-only installs too

        handle = ctypes.c_void_p()
        with torch.cuda.device(self.device_index):  # an event belongs to the device current at its creation
            err = self.rt.event_create(ctypes.byref(handle), self.flags)
        if err:
            self.rt.fail("cudaEventCreateWithFlags", err)
        self.created += 1
        return self.event_type(self.rt, handle.value, free)


class CudaRuntime:
    """Copies, events and cross-stream waits through the CUDA runtime library this process has mapped.

    Why: each ``torch.cuda.Event`` record or ``Stream.wait_event`` goes through one or two Python frames of
    PyTorch's wrappers before its C++ call, 8-11 µs of host time per call inside a launch-bound step (session 11's
    breakdown: ``LinkTelemetry.mark`` 10.4 µs a call, about 14 such calls per offloaded group). A ctypes call into
    the runtime is the C call alone. Streams are raw ``cudaStream_t`` values (``torch.cuda.Stream.cuda_stream``,
    ``torch._C._cuda_getCurrentRawStream``), so these events order work on PyTorch's own streams.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i, u = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint

        def bind(name: str, *argtypes: Any) -> Any:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
            return fn

        self.memcpy = bind("cudaMemcpyAsync", vp, vp, ctypes.c_size_t, i, vp)
        self.memcpy_address = ctypes.cast(self.memcpy, vp).value  # for the C++ copy loop (runtime/native)
        self.event_create = bind("cudaEventCreateWithFlags", ctypes.POINTER(vp), u)
        self.event_record = bind("cudaEventRecord", vp, vp)
        self.stream_wait = bind("cudaStreamWaitEvent", vp, vp, u)
        self.event_query = bind("cudaEventQuery", vp)
        # for the C++ copy bursts (runtime/native/bursts.cpp), which call these four at their addresses
        self.call_addresses = tuple(ctypes.cast(f, vp).value for f in (self.memcpy, self.event_record,
                                                                         self.stream_wait, self.event_query))
        self.event_synchronize = bind("cudaEventSynchronize", vp)
        self.event_elapsed = bind("cudaEventElapsedTime", ctypes.POINTER(ctypes.c_float), vp, vp)
        self.host_alloc = bind("cudaHostAlloc", ctypes.POINTER(vp), ctypes.c_size_t, u)
        self.free_host = bind("cudaFreeHost", vp)
        # cudaMemcpyBatchAsync (CUDA >= 13): one call for a burst's copies instead of one per storage. Opt-in
        # (MCORE_OFFLOAD_BATCH_COPY=1): on the H100 host it cost more host time than three cudaMemcpyAsync
        # (session 13, copy_thread_cost.py inline_batch: 113 against 96 µs per layer's two bursts). None: one by one.
        self.memcpy_batch: Any = None
        version = ctypes.c_int(0)
        get_version = getattr(lib, "cudaRuntimeGetVersion", None)
        if get_version is not None and get_version(ctypes.byref(version)) != 0:
            version.value = 0  # unknown
        if (os.environ.get("MCORE_OFFLOAD_BATCH_COPY", "0") == "1" and hasattr(lib, "cudaMemcpyBatchAsync")
                and version.value >= BATCH_COPY_MIN_VERSION):
            self.memcpy_batch = bind("cudaMemcpyBatchAsync", *BATCH_ARGTYPES)
        self.version = version.value
        self._batch_attrs = MemcpyAttributes(MEMCPY_SRC_ACCESS_ORDER_STREAM)  # one attribute for every copy
        self._batch_attr_index = (ctypes.c_size_t * 1)(0)
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes, self._error_string.restype = [i], ctypes.c_char_p
        self._lib = lib

    def function_addresses(self) -> list[int]:
        """The entry points the copy-engine experiment calls (``benchmarks/gpu/copy_engine.py``), in its order."""
        names = ("cudaSetDevice", "cudaEventRecord", "cudaStreamWaitEvent", "cudaMemcpyAsync", "cudaEventSynchronize")
        return [ctypes.cast(getattr(self._lib, n), ctypes.c_void_p).value for n in names]

    def error_string(self, err: int) -> str:
        return f"{self._error_string(err).decode()} (error {err})"

    def fail(self, what: str, err: int) -> None:
        raise RuntimeError(f"{what} failed: {self.error_string(err)}; "
                           f"set MCORE_OFFLOAD_RAW_COPY=0 to use PyTorch's copies and events instead")

    def memcpy_many(self, dsts: list[int], srcs: list[int], sizes: list[int], stream: int) -> int:
        """One ``cudaMemcpyBatchAsync`` for every copy (host and device pointers, any direction, sources read in
        stream order); the CUDA error code. Only where :attr:`memcpy_batch` is set."""
        n = len(dsts)
        ptrs = ctypes.c_void_p * n
        return self.memcpy_batch(ptrs(*dsts), ptrs(*srcs), (ctypes.c_size_t * n)(*sizes), n,
                                 ctypes.byref(self._batch_attrs), self._batch_attr_index, 1, stream)

    def host_tensor(self, nbytes: int, flags: int) -> Any:
        """A uint8 CPU tensor over ``nbytes`` of page-locked memory from ``cudaHostAlloc(flags)``, freed with
        ``cudaFreeHost`` when the tensor's last reference goes (callers keep it until every copy touching it has run).

        Why not ``torch.empty(pin_memory=True)``: PyTorch's host allocator takes no flags, and write-combined memory
        (:data:`HOST_ALLOC_WRITE_COMBINED`) is not snooped by the CPU's caches during PCIe transfers.
        """
        import torch  # only here: this module is imported on CPU-only installs too

        ptr = ctypes.c_void_p()
        err = self.host_alloc(ctypes.byref(ptr), max(nbytes, 1), flags)
        if err:
            self.fail("cudaHostAlloc", err)
        block = _host_block_type(nbytes).from_address(ptr.value)
        block._release = (self.free_host, ptr.value)  # the tensor holds the block, the block frees the memory
        return torch.frombuffer(block, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        err = self.memcpy(dst, src, nbytes, kind, stream)
        if err:
            self.fail("cudaMemcpyAsync", err)


class _HostBlock(ctypes.Array):
    """Base of the ctypes arrays that own a ``cudaHostAlloc`` block (:meth:`CudaRuntime.host_tensor`)."""

    _type_ = ctypes.c_uint8
    _length_ = 0
    _release: tuple[Callable[[int], int], int] | None = None

    def __del__(self) -> None:
        if self._release is not None:
            free, ptr = self._release
            free(ptr)


_HOST_BLOCK_TYPES: dict[int, type] = {}  # per length: ctypes needs one array type per length


def _host_block_type(nbytes: int) -> type:
    t = _HOST_BLOCK_TYPES.get(nbytes)
    if t is None:
        t = _HOST_BLOCK_TYPES[nbytes] = type(f"HostBlock{nbytes}", (_HostBlock,), {"_length_": nbytes})
    return t


def load_runtime(maps_path: str = "/proc/self/maps") -> CudaRuntime | None:
    """The process's CUDA runtime (:class:`CudaRuntime`), or None (not mapped, or ``MCORE_OFFLOAD_RAW_COPY=0``)."""
    if os.environ.get("MCORE_OFFLOAD_RAW_COPY", "1") == "0":
        return None
    try:
        with open(maps_path) as f:
            path = mapped_cudart(f.read())
        if path is None:
            logger.info("no CUDA runtime library mapped in this process: offload copies use PyTorch's copy_")
            return None
        # RTLD_NOLOAD: the mapped library, or an OSError; never a second copy from disk. RTLD_LOCAL: the process's
        # symbol scope stays as the process made it (PyTorch's wheels already load libcudart globally, through
        # libtorch_global_deps; where a build loads it locally, RTLD_GLOBAL, used until session 26, would promote it
        # for every later dlopen).
        runtime = CudaRuntime(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL))
        logger.info("offload copies and events through the CUDA runtime at %s (version %d)", path, runtime.version)
        return runtime
    except (OSError, AttributeError) as e:
        logger.info("raw CUDA runtime calls unavailable (%s): offload copies use PyTorch's copy_", e)
        return None


def load_memcpy_async(maps_path: str = "/proc/self/maps") -> MemcpyAsync | None:
    """``memcpy_async(dst, src, nbytes, kind, stream)`` bound to the process's CUDA runtime, or None."""
    rt = load_runtime(maps_path)
    return None if rt is None else rt.memcpy_async
