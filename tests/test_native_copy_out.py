"""The C++ copy-out (runtime/native/copy_path.cpp: copy_out): the flush of a step that neither audits nor probes,
deciding and counting exactly as the Python flush does."""

from __future__ import annotations

import gc

import pytest
import torch

from mcore_offload.runtime import native
from mcore_offload.runtime.manager import get_manager, reset
from mcore_offload.runtime.saved import Entry
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
        held = module.held_elsewhere(storage, [ref])  # not inside the assert: pytest keeps its operands
        assert held is expected, name


def _many_ref_cases():
    """(name, storage, refs, what else keeps alive, expected answer); no test-frame name refers to a saved tensor."""
    from mcore_offload.runtime.saved import Group, SavedRef

    group = Group("core_attn")

    def refs_of(*tensors):
        return [SavedRef(t, group, "core_attn") for t in tensors]

    qkv = torch.randn(3, 8, 8)
    sole = refs_of(*qkv.unbind(0))  # q, k and v: views of one projection's output, which only they keep
    del qkv
    kept_base = torch.randn(3, 8, 8)
    base_named = refs_of(*kept_base.unbind(0))
    other = torch.randn(4, 16)
    other_tensor = refs_of(other[:2], other[2:])
    other_keeper = other.view(64)  # a tensor that is neither saved nor a base of a saved view
    del other
    out = torch.randn(8, 8)
    out_and_view = refs_of(out, out.view(64))  # attention's output saved by core_attn, its reshape by attn_proj
    del out
    twice_t = torch.randn(8, 8)
    twice = refs_of(twice_t[:4], twice_t[:4], twice_t[4:])
    del twice_t
    named_t = torch.randn(8, 8)
    named = refs_of(named_t[:4], named_t[4:])
    named_view = named[0].tensor
    del named_t
    splits = torch.randn(64, 8)
    experts = refs_of(*torch.split(splits, 4))  # a grouped GEMM's split per expert
    del splits
    return [
        ("q, k, v whose base nobody else holds", sole, None, False),
        ("q, k, v whose base Python still holds", base_named, kept_base, True),
        ("another tensor on the storage", other_tensor, other_keeper, True),
        ("a saved tensor and a saved view of it", out_and_view, None, False),
        ("one view saved twice", twice, None, False),
        ("a saved view named elsewhere", named, named_view, True),
        ("sixteen expert splits", experts, None, False),
    ]


def test_the_cpp_many_references_check_answers_like_the_python_one(module):
    from mcore_offload.runtime.saved import held_by_other_than_many

    for name, refs, _keeper, expected in _many_ref_cases():
        storage = refs[0].tensor.untyped_storage()
        python = held_by_other_than_many(storage, refs)  # not inside the assert: pytest keeps its operands
        cpp = module.held_elsewhere(storage, refs)
        assert python is expected, name
        assert cpp is expected, name


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
    # the layers' flushes through handler.flush, where the wrapper below sees them (the C++ layer boundary calls the
    # C++ copy-out without it; tests/test_native_link_calls.py compares that boundary with the Python one)
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "0")
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


def test_released_storages_leave_the_live_table_and_are_counted(module, monkeypatch):
    """The release callback: once the copied device storage is freed, its entry leaves handler.live (no entry keeps a
    dead address that a new storage could reuse) and the bytes count as released in forward."""
    from mcore_offload.runtime.handler import ChunkOffloadHandler

    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "0")  # the layers' flushes through handler.flush, seen below
    reset()
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


class _FakeTransport:
    """to_device's contract: one fresh storage per entry and one done event per run; records what it was given."""

    def __init__(self):
        self.reload_seq, self.calls = 0, []

    def to_device(self, hosts, sizes, after, device, parts=None):
        self.calls.append((list(sizes), list(after), parts))
        return [torch.empty(n, dtype=torch.uint8).untyped_storage() for n in sizes], \
            [f"event{len(self.calls)}.{i}" for i in range(len(parts) if parts else 1)]


def _entries(entry_type):
    """Five entries: three on the host only (one listed twice), one back on the device, one without a host copy."""
    es = [entry_type(p, n, torch.empty(n, dtype=torch.uint8), f"d2h{i}", 100 + i)
          for i, (p, n) in enumerate([("qkv_linear", 16), ("core_attn", 32), ("core_attn", 8), ("attn_proj", 4),
                                      ("core_attn", 2)])]
    for e in es[:3]:
        e.off_device = True
    es[3].device_storage = torch.empty(4, dtype=torch.uint8).untyped_storage()
    es[4].host = None
    return es


@pytest.mark.parametrize("tracing", [False, True])
@pytest.mark.parametrize("on_demand", [False, True])
def test_the_cpp_reload_does_what_the_python_reload_does(module, monkeypatch, tracing, on_demand):
    """Both reloads over the same runs: the same to_device calls, the same fields on every entry, the same counters
    (entry by entry while the summary traces the peak, per point otherwise)."""
    from mcore_offload.runtime.handler import ChunkOffloadHandler

    seen = {}
    for impl in ("native", "python"):
        reset()
        manager = get_manager()
        if impl == "python":
            monkeypatch.setattr(manager, "native", None)
        handler = ChunkOffloadHandler(manager, None, 0, torch.device("cpu"), 1, set())
        handler.transport = transport = _FakeTransport()
        transport.reload_seq = 5
        summary = get_summary()
        if tracing:
            summary.track_peak(lambda: 0, by_key=True)
        summary.off_device(+56)
        es = _entries(module.Entry if impl == "native" else Entry)
        handler._reload([es[0], es[3], es[0]], [es[1], es[4]], [], [es[2]], on_demand=on_demand)
        handler._reload([es[3]])  # nothing on the host only: no call
        fields = [(e.device_storage.nbytes(), e.h2d_event, e.h2d_seq, e.compute_waited, e.off_device) for e in es[:3]]
        seen[impl] = (transport.calls, transport.reload_seq, fields, dict(summary._current), summary.off_device_bytes)
    assert seen["native"] == seen["python"]
    calls, seq, fields, counters, off = seen["native"]
    assert {p: c["reloaded"] for p, c in counters.items()} == {"qkv_linear": 16, "core_attn": 40}
    assert {p: c["reloaded_on_demand"] for p, c in counters.items()} == (
        {"qkv_linear": 16, "core_attn": 40} if on_demand else {"qkv_linear": 0, "core_attn": 0})
    assert off == 0  # 56 bytes were off the device: all three are back
    assert calls == [([16, 32, 8], ["d2h0", "d2h1", "d2h2"], [1, 1, 1])] and seq == 8
    assert fields == [(16, "event1.0", 6, False, False), (32, "event1.1", 7, False, False),
                      (8, "event1.2", 8, False, False)]


@pytest.mark.parametrize("tracing", [False, True])
def test_released_counters_are_counted_in_cpp_unless_the_summary_traces_the_peak(module, monkeypatch, tracing):
    """The release callback counts in C++ what manager.on_released counts (the counters above, and the bytes off the
    device); while the summary traces the peak (each change reads the allocator) it calls the Python method."""
    from mcore_offload.runtime.manager import OffloadManager

    calls: list = []
    on_released = OffloadManager.on_released

    def counted(self, entry, during_forward):
        calls.append(entry.nbytes)
        return on_released(self, entry, during_forward)

    monkeypatch.setattr(OffloadManager, "on_released", counted)
    off_device: list = []
    reset()
    summary = get_summary()
    if tracing:
        summary.track_peak(lambda: 0)
    from mcore_offload.runtime.handler import ChunkOffloadHandler

    def watching(self, *runs, on_demand=False):  # the bytes off the device just before each reload
        off_device.append(get_summary().off_device_bytes)
        return reload(self, *runs, on_demand=on_demand)

    reload = ChunkOffloadHandler._reload
    monkeypatch.setattr(ChunkOffloadHandler, "_reload", watching)
    run(["qkv_linear", "core_attn", "attn_proj"], steps=1, microbatches=1)
    last = get_summary().last_step.points
    released = sum(c["released_in_forward"] for c in last.values())
    assert released == sum(c["offloaded"] for c in last.values()) > 0
    assert (sum(calls) == released) if tracing else not calls
    assert max(off_device) > 0 and get_summary().off_device_bytes == 0
