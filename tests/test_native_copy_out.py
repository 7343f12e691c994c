"""The C++ copy-out (runtime/native/copy_path.cpp: copy_out): the flush of a step that neither audits nor probes,
deciding and counting exactly as the Python flush does."""

from __future__ import annotations

import gc

import pytest
import torch

from mcore_offload.runtime import native
from mcore_offload.runtime.handler import Entry
from mcore_offload.runtime.manager import get_manager, reset
from mcore_offload.summary import get_summary
from tests.test_runtime_unit import _one_ref_cases, run


@pytest.fixture
def module(monkeypatch):
    if native.toolchain_missing():  # where the tools are there, a failed build fails the test
        pytest.skip(f"the C++ copy-out cannot be built here: {native.toolchain_missing()}")
    reset()
    native.reset()
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "1")
    yield native.load_native()
    reset()
    native.reset()


def test_the_cpp_one_reference_check_answers_like_the_python_one(module):
    for case in _one_ref_cases():  # the case tuple is the only extra holder of its keeper: one reference
        name, ref, expected = case[0], case[1], case[3]
        storage = ref.tensor.untyped_storage()
        held = module.held_by_other_than_one(storage, ref)  # not inside the assert: pytest keeps its operands
        assert held is expected, name


def test_the_cpp_entry_has_the_python_entrys_fields_and_initial_values(module):
    host = torch.empty(4, dtype=torch.uint8)
    ours, theirs = module.Entry("core_attn", 16, host, None, 1234), Entry("core_attn", 16, host, None, 1234)
    for name in Entry.__slots__:
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a is b or (type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b), name
    ours.users += 2
    ours.device_storage = host.untyped_storage()
    assert ours.users == 2 and ours.device_storage is not None
    assert module.Entry("x", 1, None, None).device_ptr == 0


def _summaries(names, monkeypatch, mode, calls):
    """The per-point counters of each step of ``run(names)`` under MCORE_OFFLOAD_NATIVE=``mode``, with every
    copy_out call counted in ``calls``."""
    reset()
    native.reset()
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", mode)
    manager = get_manager()
    if manager.native is not None:
        real = manager.native

        class Counting:
            def __getattr__(self, name):
                return getattr(real, name)

            def copy_out(self, *args):
                calls.append(args[0])
                return real.copy_out(*args)

        manager.native = Counting()
    results = run(names, steps=3, microbatches=2)
    steps = [{p: dict(c) for p, c in s.points.items()} for s in get_summary().steps]
    return results, steps, get_summary().host_resident_peak_bytes


@pytest.mark.parametrize("names", [["qkv_linear"], ["core_attn"], ["qkv_linear", "core_attn", "attn_proj"]])
def test_the_cpp_copy_out_counts_and_computes_as_the_python_flush(module, monkeypatch, names):
    calls: list = []
    got, got_steps, got_peak = _summaries(names, monkeypatch, "1", calls)
    assert calls, "the C++ copy-out was not used"
    want, want_steps, want_peak = _summaries(names, monkeypatch, "0", [])
    for (l0, g0), (l1, g1) in zip(want, got):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert got_steps == want_steps and got_peak == want_peak
    last = got_steps[-1]
    assert sum(c["offloaded"] for c in last.values()) > 0
    assert all(c["released_in_forward"] == c["offloaded"] == c["reloaded"] for c in last.values())
    assert get_summary().host_resident_bytes == 0 and not get_manager().handlers


def test_an_audited_step_keeps_the_python_flush(module, monkeypatch):
    """``offload_log`` (the audit) is appended to by the Python flush only: the C++ copy-out must stay out of it."""
    calls: list = []
    reset()
    manager = get_manager()
    manager.offload_log = []
    real = manager.native
    monkeypatch.setattr(manager, "native", type("N", (), {
        "__getattr__": lambda self, name: getattr(real, name),
        "copy_out": lambda self, *a: calls.append(a)})())
    run(["core_attn"], steps=1, microbatches=1)
    assert not calls and manager.offload_log


def test_released_storages_leave_the_live_table_and_are_counted(module):
    """The release callback: once the copied device storage is freed, its entry leaves handler.live (no entry keeps a
    dead address that a new storage could reuse) and the bytes count as released in forward."""
    from mcore_offload.runtime.handler import ChunkOffloadHandler

    seen: list = []  # the handlers are made and dropped within the step: keep each one that flushed
    flush = ChunkOffloadHandler.flush

    def recording(self):
        flush(self)
        seen.append(self)

    try:
        ChunkOffloadHandler.flush = recording
        run(["qkv_linear", "core_attn", "attn_proj"], steps=1, microbatches=1)
    finally:
        ChunkOffloadHandler.flush = flush
    gc.collect()
    assert seen and all(not h.live for h in seen)
    last = get_summary().last_step.points
    assert sum(c["released_in_forward"] for c in last.values()) == sum(c["offloaded"] for c in last.values()) > 0
