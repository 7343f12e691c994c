"""The C++ saved-tensor hooks (runtime/native): built here, deciding exactly as the Python hooks do, and falling back
with one sentence when they cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from mcore_offload.runtime import native, points
from mcore_offload.runtime.handler import ChunkOffloadHandler
from mcore_offload.runtime.manager import get_manager
from mcore_offload.runtime.saved import SavedRef


@pytest.fixture
def module(monkeypatch):
    if native.toolchain_missing():  # where the tools are there, a failed build fails the test
        pytest.skip(f"the C++ hooks cannot be built here: {native.toolchain_missing()}")
    native.reset()
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "1")  # CI has a compiler: a failed build fails here
    yield native.load_native()
    native.reset()


def _handler(min_numel: int = 4, not_offloadable: set[int] | None = None) -> ChunkOffloadHandler:
    return ChunkOffloadHandler(get_manager(), None, 0, torch.device("cpu"), min_numel, not_offloadable or set())


class _Sub(torch.Tensor):
    pass


def _cases(protected: torch.Tensor) -> dict[str, torch.Tensor]:
    leaf = torch.randn(8, 8, requires_grad=True)
    marked = torch.randn(8, 8)
    marked.offloading_activation = False
    also_marked_true = torch.randn(8, 8)
    also_marked_true.offloading_activation = True
    return {
        "plain": torch.randn(8, 8),
        "view of a large storage": torch.randn(64, 8)[:2],
        "parameter": torch.nn.Parameter(torch.randn(8, 8)),
        "leaf that requires grad": leaf,
        "view of such a leaf": leaf[:4],
        "small": torch.randn(2),
        "small view of a large storage": torch.randn(64)[:2],
        "protected storage": protected[1:],
        "conj view": torch.randn(8, 8, dtype=torch.complex64).conj(),
        "neg view": torch._neg_view(torch.randn(8, 8, dtype=torch.complex64).conj()),
        "marked not offloadable": marked,
        "marked offloadable": also_marked_true,
        "tensor subclass": torch.randn(8, 8).as_subclass(_Sub),
        "sparse": torch.randn(8, 8).to_sparse(),
        "empty": torch.empty(0),
        "bool": torch.ones(16, dtype=torch.bool),
    }


def test_the_cpp_pack_hook_decides_as_the_python_one(module):
    """Every kind of saved tensor gets the same answer (kept as it is, or wrapped) and the same counted reason."""
    protected = torch.randn(16)
    handler = _handler(not_offloadable={protected.untyped_storage().data_ptr()})
    cases = _cases(protected)
    g_py, g_cpp = handler.open_group("core_attn"), handler.open_group("core_attn")
    py_pack = points._python_pack(handler, g_py, "core_attn")
    cpp_pack = module.Packer(handler, g_cpp, "core_attn")
    for name, t in cases.items():
        a, b = py_pack(t), cpp_pack(t)
        assert isinstance(a, SavedRef) == isinstance(b, module.SavedRef), name
        if isinstance(b, module.SavedRef):
            assert b.tensor is t and b.group is g_cpp and b.point == "core_attn" and b.entry is None, name
        else:
            assert a is t and b is t, name
    assert g_cpp.rejected == g_py.rejected and g_cpp.parameters == g_py.parameters == 1
    assert len(g_cpp.refs) == len(g_py.refs) > 0
    assert [r.tensor for r in g_cpp.refs] == [r.tensor for r in g_py.refs]
    # the reasons cover every check the C++ hook makes itself
    assert set(g_cpp.rejected) >= {"parameter", "under min_offloaded_tensor_size", "parameter or main_grad storage",
                                   "lazy conj/neg view", "marked not offloadable", "tensor subclass or layout"}
    assert handler.summary.runtime_total_ns() > 0


def test_the_cpp_hooks_add_their_time_to_the_summarys_native_clock(module):
    """The manager gives its summary a RuntimeClock where the C++ runtime is loaded; the C++ hooks add to it, a
    step's record reads both clocks and empties both, and a summary without one gets the time in runtime_ns."""
    manager = get_manager()
    summary = manager.summary
    assert isinstance(summary.native_clock, module.RuntimeClock)
    handler = _handler()
    group = handler.open_group("core_attn")
    pack, unpack = module.Packer(handler, group, "core_attn"), module.Unpacker(handler)
    ref = pack(torch.randn(8, 8))
    assert isinstance(ref, module.SavedRef) and unpack(ref) is ref.tensor
    assert summary.native_clock.ns > 0 and summary.runtime_ns == 0
    summary.runtime_ns = 5
    assert summary.runtime_total_ns() == summary.native_clock.ns + 5
    summary.add("core_attn", "offloaded", 1)  # a step with activity leaves a record
    total = summary.runtime_total_ns()
    summary.close_step()
    assert summary.steps[-1].runtime_cpu_ms == total / 1e6
    assert summary.native_clock.ns == 0 and summary.runtime_ns == 0
    clock = module.RuntimeClock()
    clock.add(7)
    assert clock.take() == 7 and clock.ns == 0
    summary.native_clock = None  # a summary of its own, say: the hooks fall back to runtime_ns
    module.Packer(handler, handler.open_group("core_attn"), "core_attn")(torch.randn(8, 8))
    assert summary.runtime_ns > 0


def test_a_finished_handler_packs_nothing(module):
    handler = _handler()
    group = handler.open_group("core_attn")
    handler.finished = True
    t = torch.randn(8, 8)
    assert module.Packer(handler, group, "core_attn")(t) is t and not group.refs and not group.rejected


def test_the_cpp_unpack_hook_returns_kept_tensors_and_hands_python_refs_back(module):
    handler = _handler()
    unpack = module.Unpacker(handler)
    t = torch.randn(8, 8)
    assert unpack(t) is t
    group = handler.open_group("core_attn")
    assert unpack(module.SavedRef(t, group, "core_attn")) is t  # not offloaded: the very tensor
    assert unpack(SavedRef(t, group, "core_attn")) is t  # a Python ref goes to tensor_pop


def test_the_cpp_unpack_hook_rebuilds_a_view_with_its_layout(module):
    """A reloaded entry: the view comes back on its storage with the saved offset, sizes and strides."""
    handler = _handler()
    base = torch.arange(48, dtype=torch.float32)
    view = base.view(6, 8)[1:5, 2:7]
    ref = module.SavedRef(view, handler.open_group("core_attn"), "core_attn")
    ChunkOffloadHandler._attach(_Entry(base.untyped_storage()), [ref])
    assert ref.tensor is None
    got = module.Unpacker(handler)(ref)
    assert got.dtype == view.dtype and got.shape == view.shape and got.stride() == view.stride()
    assert got.storage_offset() == view.storage_offset() and torch.equal(got, view)
    assert got.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def test_the_cpp_ref_keeps_its_layout_as_values_python_reads_and_writes(module):
    """SavedRef's dtype / offset / size / stride live in C++ (no Python ints or tuples kept): None until set, read
    back as the torch.dtype, an int and tuples, refused when of the wrong type (the old value kept), never deleted;
    a layout with a field missing is not rebuilt."""
    handler = _handler()
    base = torch.arange(48, dtype=torch.float16)
    ref = module.SavedRef(base, handler.open_group("core_attn"), "core_attn")
    assert (ref.dtype, ref.offset, ref.size, ref.stride) == (None, None, None, None)
    ref.dtype, ref.offset, ref.size, ref.stride = torch.float16, 3, torch.Size([5, 9]), [9, 1]
    assert (ref.dtype, ref.offset, ref.size, ref.stride) == (torch.float16, 3, (5, 9), (9, 1))
    assert type(ref.size) is tuple and type(ref.stride) is tuple
    for field, bad in (("dtype", "float16"), ("offset", 2.5), ("size", (5, "9")), ("stride", 7)):
        with pytest.raises(TypeError):
            setattr(ref, field, bad)
        with pytest.raises(AttributeError, match="cannot be deleted"):
            delattr(ref, field)
    assert (ref.dtype, ref.offset, ref.size, ref.stride) == (torch.float16, 3, (5, 9), (9, 1))
    entry = _Entry(base.untyped_storage())
    ref.entry, ref.tensor = entry, None
    got = module.Unpacker(handler)(ref)
    assert torch.equal(got, base[3:].as_strided((5, 9), (9, 1))) and got.storage_offset() == 3
    ref.stride = None
    with pytest.raises(RuntimeError, match="lacks its view's layout"):
        module.Unpacker(handler)(ref)


def test_an_entry_back_but_not_yet_waited_for_waits_once_then_rebuilds(module, monkeypatch):
    """A split chain's first point: its storage is back and the compute stream has not waited for its burst yet. The
    unpack hook makes handler._rebuild's wait itself (transport.wait_reload with the entry's event and burst number),
    marks the entry waited and rebuilds the view, without the handler's Python method."""
    handler = _handler()
    rebuilt, waits = [], []
    handler._rebuild = lambda ref: rebuilt.append(ref) or torch.zeros(1)
    monkeypatch.setattr(handler.transport, "wait_reload", lambda event, seq: waits.append((event, seq)))
    base = torch.randn(4)
    ref = module.SavedRef(base, handler.open_group("core_attn"), "core_attn")
    entry = _Entry(base.untyped_storage())
    entry.compute_waited, entry.h2d_event, entry.h2d_seq = False, "burst 7 done", 7
    ChunkOffloadHandler._attach(entry, [ref])
    got = module.Unpacker(handler)(ref)
    assert torch.equal(got, base) and rebuilt == []
    assert waits == [("burst 7 done", 7)] and entry.compute_waited is True
    module.Unpacker(handler)(ref)  # waited now: no second wait
    assert waits == [("burst 7 done", 7)]


def test_an_entry_not_back_yet_goes_through_the_handler(module):
    handler = _handler()
    calls = []
    handler._rebuild = lambda ref: calls.append(ref) or torch.zeros(1)
    ref = module.SavedRef(torch.randn(4), handler.open_group("core_attn"), "core_attn")
    entry = _Entry(torch.randn(4).untyped_storage())
    ChunkOffloadHandler._attach(entry, [ref])
    entry.device_storage = None  # on the host only: the handler reloads it inline
    module.Unpacker(handler)(ref)
    assert calls == [ref]


class _Entry:
    """What the unpack hook reads of a reloaded saved.Entry."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.device_storage, self.compute_waited, self.users = storage, True, 0
        self.awaiting, self.reloaded_ref = 0, None


def test_the_manager_uses_the_cpp_hooks_by_default(module, monkeypatch):
    monkeypatch.delenv("MCORE_OFFLOAD_NATIVE")
    assert get_manager().native is module


def test_a_failed_build_falls_back_with_one_warning_or_raises_when_required(monkeypatch, caplog):
    def broken(verbose: bool = False):
        raise OSError("no C++ compiler")

    monkeypatch.setattr(native, "build", broken)
    native.reset()
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "auto")
    with caplog.at_level(logging.WARNING, logger="mcore_offload"):
        assert native.load_native() is None
        assert native.load_native() is None  # tried once per process
    assert [r.getMessage() for r in caplog.records if "did not build" in r.getMessage()] == [
        "mcore-offload: the C++ saved-tensor hooks did not build (no C++ compiler); using the Python hooks "
        "(set MCORE_OFFLOAD_NATIVE=0 to skip this attempt)"]
    native.reset()
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "1")
    with pytest.raises(RuntimeError, match="MCORE_OFFLOAD_NATIVE=1 but the C\\+\\+ hooks did not build"):
        native.load_native()
    native.reset()


def test_a_bad_mode_is_one_sentence(monkeypatch):
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "yes")
    with pytest.raises(ValueError, match="MCORE_OFFLOAD_NATIVE='yes' is not one of auto"):
        native.load_native()


@pytest.mark.skipif(native.toolchain_missing() is not None, reason="needs a C++ compiler and ninja")
def test_ranks_building_at_once_into_an_empty_cache_all_load_it(tmp_path):
    """torchrun starts every rank at once: one compiles, the others wait for its lock, and all load the same build;
    the lock file a killed build left behind does not make them wait for ever."""
    import os
    import subprocess
    import sys

    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from mcore_offload.runtime import native\n"
            "print(native.build().__file__)")
    env = {**os.environ, "MCORE_OFFLOAD_CACHE_DIR": str(tmp_path)}
    directory = tmp_path / native.build_name()
    directory.mkdir()
    (directory / "lock").touch()  # PyTorch's builder waits for this file to go, without end
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    paths = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(paths) == 1 and str(directory) in paths.pop()


def test_the_build_compiles_one_file_that_includes_every_source_and_keeps_it_while_unchanged(tmp_path):
    """One translation unit (the headers parsed once); the file is not rewritten when its text is the same, since a
    newer file would make ninja compile again on every load."""
    import os

    path = native.unity_source(tmp_path)
    lines = path.read_text().splitlines()
    assert [line for line in lines if line.startswith("#include")] == [f'#include "{p}"' for p in native.SOURCES]
    os.utime(path, (1, 1))
    assert native.unity_source(tmp_path) == path and path.stat().st_mtime == 1
    path.write_text("// stale\n")
    native.unity_source(tmp_path)
    assert path.read_text().splitlines() == lines


def _saved_groups(ref_type, handler):
    """Two groups saving q, k, v views of one fused storage, a tensor of its own, and one view again."""
    fused = torch.randn(8, 48)
    own = torch.randn(4, 4)
    q, k, v = fused.split(16, dim=-1)
    g1, g2 = handler.open_group("qkv_linear"), handler.open_group("core_attn")
    g1.refs += [ref_type(q, g1, "qkv_linear"), ref_type(own, g1, "qkv_linear")]
    g2.refs += [ref_type(k, g2, "core_attn"), ref_type(v.t(), g2, "core_attn"), ref_type(q, g2, "core_attn")]
    done = ref_type(torch.randn(3), g2, "core_attn")
    done.tensor = None  # attached already: skipped
    g2.refs.append(done)
    return [g1, g2], (fused, own)


def test_the_cpp_flush_grouping_and_attach_match_the_python_ones(module):
    handler = _handler()
    for ref_type in (module.SavedRef, SavedRef):  # the C++ helpers also take Python refs
        groups, keep = _saved_groups(ref_type, handler)
        got = module.storages_of(groups)
        want: dict = {}
        for g in groups:
            for r in g.refs:
                if r.tensor is not None:
                    st = r.tensor.untyped_storage()
                    want.setdefault(st.data_ptr(), (st, []))[1].append(r)
        assert list(got) == list(want) == [t.untyped_storage().data_ptr() for t in keep]
        for ptr, (st, refs) in got.items():
            assert st.data_ptr() == ptr and st.nbytes() == want[ptr][0].nbytes() and refs == want[ptr][1]
        layouts = {id(r): (r.tensor.dtype, r.tensor.storage_offset(), tuple(r.tensor.shape), r.tensor.stride())
                   for g in groups for r in g.refs if r.tensor is not None}
        entry = _Entry(torch.randn(1).untyped_storage())
        fused_refs = got[keep[0].untyped_storage().data_ptr()][1]
        module.attach(entry, fused_refs)
        for r in fused_refs:
            assert r.tensor is None and r.entry is entry
            assert (r.dtype, r.offset, tuple(r.size), tuple(r.stride)) == layouts[id(r)]
        # each group lists the entry once and the entry counts each group once
        assert [g.entries for g in groups] == [[entry], [entry]] and entry.users == 2
        module.attach(entry, [ref_type(torch.randn(2), groups[1], "core_attn")])
        assert groups[1].entries == [entry] and entry.users == 2


def test_attach_refuses_a_ref_without_its_tensor(module):
    handler = _handler()
    ref = module.SavedRef(torch.randn(2), handler.open_group("core_attn"), "core_attn")
    ref.tensor = None
    with pytest.raises(RuntimeError, match="no tensor left"):
        module.attach(_Entry(torch.randn(1).untyped_storage()), [ref])


def test_the_cpp_copy_loop_passes_each_copy_to_the_runtime_and_stops_at_the_first_error(module):
    """The loop calls the function at the given address (here a ctypes callback standing in for cudaMemcpyAsync) with
    each copy's addresses, size, kind and stream, in order."""
    import ctypes

    calls = []
    answers = iter([0, 0, 700])

    @ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
    def fake_memcpy(dst, src, n, kind, stream):
        calls.append((dst, src, n, kind, stream))
        return next(answers)

    address = ctypes.cast(fake_memcpy, ctypes.c_void_p).value
    hosts = [torch.empty(64, dtype=torch.uint8), torch.empty(32, dtype=torch.uint8)]
    storages = module.empty_storages([64, 16], -1)
    assert [s.nbytes() for s in storages] == [64, 16] and storages[0].data_ptr() != storages[1].data_ptr()
    assert module.copy_burst(address, storages, hosts, [64, 16], 1, 1234) == 0
    assert calls == [(storages[0].data_ptr(), hosts[0].data_ptr(), 64, 1, 1234),
                     (storages[1].data_ptr(), hosts[1].data_ptr(), 16, 1, 1234)]
    calls.clear()
    assert module.copy_burst(address, hosts, storages, [8, 8], 2, 5) == 700  # its first copy fails: no second one
    assert calls == [(hosts[0].data_ptr(), storages[0].data_ptr(), 8, 2, 5)]
    with pytest.raises(ValueError, match="three lists of one length"):
        module.copy_burst(address, hosts, storages[:1], [8, 8], 2, 5)
    with pytest.raises(TypeError, match="tensors and untyped storages only"):
        module.copy_burst(address, [object()], storages[:1], [8], 2, 5)


def test_a_cpp_node_prehook_runs_before_its_node_and_passes_the_gradients_through(module):
    order = []
    x = torch.randn(4, requires_grad=True)
    x.register_hook(lambda grad: order.append("x's gradient, made by y's node"))
    y = x * 2
    assert module.add_prehook(y, lambda grads: order.append(("hook", grads))) is True
    assert module.add_prehook(x, order.append) is False  # a leaf has no node: the caller adds one of its own
    (y * 3).sum().backward()
    assert order == [("hook", None), "x's gradient, made by y's node"]
    assert torch.equal(x.grad, torch.full((4,), 6.0))


def test_a_failing_cpp_node_prehook_fails_the_backward_with_its_own_error(module):
    x = torch.randn(4, requires_grad=True)
    y = x * 2

    def fails(_):
        raise ValueError("the hook's own message")

    module.add_prehook(y, fails)
    with pytest.raises(ValueError, match="the hook's own message"):
        y.sum().backward()
    with pytest.raises(TypeError, match="fn must be callable"):
        module.add_prehook(x * 2, 3)


# Under torch.use_deterministic_algorithms(True) (what Megatron's bitwise-reproducible runs set) at::empty fills every
# new tensor. The C++ reload allocations and rebuilt views must not: the reload copy overwrites the storage whole and
# a view allocates nothing (session 31's profile of config A: one fill kernel per reloaded storage).

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
    handler = _handler()
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
    handler = _handler()
    view = torch.arange(48, dtype=torch.float32).view(6, 8)[1:5]
    ref = module.SavedRef(view, handler.open_group("core_attn"), "core_attn")
    ChunkOffloadHandler._attach(_Entry(torch.zeros(39, dtype=torch.float32).untyped_storage()), [ref])
    with pytest.raises(RuntimeError, match="reaches byte 160 of a reloaded storage of 156;"):
        module.Unpacker(handler)(ref)
