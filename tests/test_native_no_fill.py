"""Under ``torch.use_deterministic_algorithms(True)`` (what Megatron's bitwise-reproducible runs set), ``at::empty``
fills every new tensor. The C++ reload allocations and rebuilt views must not: the reload copy overwrites the storage
whole and a view allocates nothing (session 31's profile of config A: one fill kernel per reloaded storage)."""

from __future__ import annotations

import pytest
import torch

from mcore_offload.runtime import native
from mcore_offload.runtime.handler import ChunkOffloadHandler
from mcore_offload.runtime.manager import get_manager


@pytest.fixture
def module(monkeypatch):
    if native.toolchain_missing():
        pytest.skip(f"the C++ hooks cannot be built here: {native.toolchain_missing()}")
    native.reset()
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "1")
    yield native.load_native()
    native.reset()


@pytest.fixture
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def _op_counts(fn) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    counts: dict[str, int] = {}
    for e in prof.events():
        counts[e.name] = counts.get(e.name, 0) + 1
    return counts


class _Entry:
    """What the unpack hook reads of a reloaded saved.Entry."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.device_storage, self.compute_waited, self.users = storage, True, 0


def test_reload_storages_are_not_filled(module, deterministic):
    assert _op_counts(lambda: torch.empty(64, dtype=torch.uint8)).get("aten::fill_") == 1  # the profiler sees fills
    module.empty_storages([8], -1)  # the first call reads the allocator from one at::empty
    got = []
    counts = _op_counts(lambda: got.extend(module.empty_storages([16, 0, 4096], -1)))
    assert "aten::fill_" not in counts and "aten::empty" not in counts
    assert [s.nbytes() for s in got] == [16, 0, 4096] and all(s.device.type == "cpu" for s in got)
    got[2][4095] = 7  # writable, and a storage of its own
    assert got[2][4095] == 7 and got[2].data_ptr() != got[1].data_ptr()


def test_a_rebuilt_view_is_not_filled_and_keeps_its_layout(module, deterministic):
    handler = ChunkOffloadHandler(get_manager(), None, 0, torch.device("cpu"), 4, set())
    base = torch.arange(48, dtype=torch.bfloat16)
    view = base.view(6, 8)[1:5, 2:7]
    ref = module.SavedRef(view, handler.open_group("core_attn"), "core_attn")
    ChunkOffloadHandler._attach(_Entry(base.untyped_storage()), [ref])
    out = []
    counts = _op_counts(lambda: out.append(module.Unpacker(handler)(ref)))
    assert "aten::fill_" not in counts and "aten::set_" not in counts
    got = out[0]
    assert got.dtype == view.dtype and got.shape == view.shape and got.stride() == view.stride()
    assert got.storage_offset() == view.storage_offset() and torch.equal(got, view)
    assert got.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert got._version == 0 and not got.requires_grad and got.is_contiguous() == view.is_contiguous()
    # a tensor like any other: autograd and in-place ops work on it
    leaf = got.float().requires_grad_()
    (leaf * 2).sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(leaf, 2.0))


def test_a_view_past_its_storage_is_refused(module):
    handler = ChunkOffloadHandler(get_manager(), None, 0, torch.device("cpu"), 4, set())
    view = torch.arange(48, dtype=torch.float32).view(6, 8)[1:5]
    ref = module.SavedRef(view, handler.open_group("core_attn"), "core_attn")
    ChunkOffloadHandler._attach(_Entry(torch.zeros(39, dtype=torch.float32).untyped_storage()), [ref])
    with pytest.raises(RuntimeError, match="reaches byte 160 of a reloaded storage of 156;"):
        module.Unpacker(handler)(ref)
