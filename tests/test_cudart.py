"""The raw-copy binding's lookup (CPU): it only ever binds the CUDA runtime already mapped in the process."""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from mcore_offload.runtime import cudart

MAPS = """\
7f1c2a000000-7f1c2a021000 r--p 00000000 103:02 1234   /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c2b000000-7f1c2b080000 r-xp 00010000 103:02 5678   /site/nvidia/cu13/lib/libcudart.so.13
7f1c2c000000-7f1c2c001000 rw-p 00000000 00:00 0
7ffd5e7d0000-7ffd5e7f1000 rw-p 00000000 00:00 0      [stack]
"""


def test_the_mapped_runtime_is_found_in_the_maps_text():
    assert cudart.mapped_cudart(MAPS) == "/site/nvidia/cu13/lib/libcudart.so.13"
    assert cudart.mapped_cudart(MAPS.replace("libcudart", "libcublas")) is None
    assert cudart.mapped_cudart("") is None


def test_no_mapped_runtime_means_no_raw_copy(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(MAPS.replace("libcudart", "libcublas"))
    assert cudart.load_memcpy_async(str(maps)) is None


def test_a_runtime_on_disk_but_not_loaded_is_never_bound(tmp_path):
    # RTLD_NOLOAD: a path that is not already loaded fails instead of loading a second CUDA runtime
    maps = tmp_path / "maps"
    maps.write_text(MAPS.replace("/site/nvidia/cu13/lib/libcudart.so.13", str(tmp_path / "libcudart.so.13")))
    (tmp_path / "libcudart.so.13").write_bytes(b"not a library")
    assert cudart.load_memcpy_async(str(maps)) is None


def test_the_switch_turns_the_raw_path_off(monkeypatch, tmp_path):
    monkeypatch.setenv("MCORE_OFFLOAD_RAW_COPY", "0")
    assert cudart.load_memcpy_async("/nonexistent/maps") is None
    monkeypatch.setenv("MCORE_OFFLOAD_RAW_COPY", "1")
    assert cudart.load_memcpy_async(str(tmp_path / "missing")) is None  # unreadable maps: no raw path either


class _FakeRuntime:
    """The entry points a RawEvent calls, answering like the CUDA runtime would."""

    def __init__(self, query_answer=0):
        self.recorded = []
        self.query_answer = query_answer

    def event_record(self, handle, stream):
        self.recorded.append((handle, stream))
        return 0

    def event_query(self, handle):
        return self.query_answer

    def fail(self, what, err):
        raise RuntimeError(f"{what} failed ({err})")


def test_a_raw_event_goes_back_to_its_pool_when_its_last_reference_goes():
    rt = _FakeRuntime()
    pool = cudart.EventPool(rt, 0, timed=True)
    pool.free.extend([11, 12])
    a, b = pool.get(), pool.get()
    assert {a.handle, b.handle} == {11, 12} and pool.free == []
    a.record(7)
    assert rt.recorded == [(a.handle, 7)]
    handle = a.handle
    del a  # nobody can wait on it any more: its handle is free again
    assert pool.free == [handle]
    c = pool.get()
    assert c.handle == handle and pool.created == 0 and b.handle != handle


def test_a_raw_event_query_tells_not_ready_from_an_error():
    pool = cudart.EventPool(_FakeRuntime(query_answer=cudart.CUDA_ERROR_NOT_READY), 0, timed=True)
    pool.free.append(1)
    assert pool.get().query() is False
    pool = cudart.EventPool(_FakeRuntime(query_answer=0), 0, timed=True)
    pool.free.append(1)
    assert pool.get().query() is True
    pool = cudart.EventPool(_FakeRuntime(query_answer=700), 0, timed=True)
    pool.free.append(1)
    with pytest.raises(RuntimeError, match="cudaEventQuery"):
        pool.get().query()


def _malloc_runtime(freed: list[int]) -> cudart.CudaRuntime:
    """A CudaRuntime whose cudaHostAlloc / cudaFreeHost are libc's malloc / free (records what it frees)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    rt = cudart.CudaRuntime.__new__(cudart.CudaRuntime)
    flags_seen = []

    def host_alloc(out, n, flags):
        flags_seen.append(flags)
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = libc.malloc(n)
        return 0

    def free_host(ptr):
        freed.append(ptr)
        libc.free(ptr)
        return 0

    rt.host_alloc, rt.free_host, rt.flags_seen = host_alloc, free_host, flags_seen
    return rt


def test_a_host_tensor_is_freed_once_when_its_last_view_goes():
    freed: list[int] = []
    rt = _malloc_runtime(freed)
    t = rt.host_tensor(3000, cudart.HOST_ALLOC_WRITE_COMBINED)
    assert t.dtype == torch.uint8 and t.numel() == 3000 and t._base is None
    assert rt.flags_seen == [cudart.HOST_ALLOC_WRITE_COMBINED]
    t.fill_(7)
    view, ptr = t[:10], t.data_ptr()
    del t
    gc.collect()
    assert freed == [] and int(view.sum()) == 70  # the view still holds the block
    del view
    gc.collect()
    assert freed == [ptr]


def test_a_failed_host_alloc_is_one_sentence():
    rt = _malloc_runtime([])
    rt.host_alloc = lambda out, n, flags: 2  # cudaErrorMemoryAllocation
    rt._error_string = lambda err: b"out of memory"
    with pytest.raises(RuntimeError, match="cudaHostAlloc failed: out of memory"):
        rt.host_tensor(100, 0)
