"""Fewer host calls per offloaded group: copy bursts spanning several layers (``MCORE_OFFLOAD_FLUSH_LAYERS``), group
starts/commits as node hooks (``MCORE_OFFLOAD_NODE_HOOKS``), no wait on a D2H already seen complete. Same values,
same bytes."""

from __future__ import annotations

import pytest
import torch
from test_runtime_unit import Toy, cfg, toy_steps, train_step

from mcore_offload.runtime import manager as manager_module
from mcore_offload.runtime import transport as transport_module
from mcore_offload.runtime.burst_settings import flush_layers_from_env, reload_layers_from_env
from mcore_offload.runtime.manager import get_manager
from mcore_offload.runtime.points import step_boundary as points_step_boundary
from mcore_offload.summary import get_summary


def _run(names, layers, steps=3, microbatches=2):
    """Losses and gradients per step, and the D2H bursts per step (the CPU transport's to_host calls)."""
    model = Toy(cfg(*names), layers=layers)
    bursts: list[int] = []
    real = transport_module.Transport.to_host

    def counted(self, *args, **kwargs):
        bursts[-1] += 1
        return real(self, *args, **kwargs)

    results = []
    transport_module.Transport.to_host = counted
    try:
        for step in range(steps):
            bursts.append(0)
            model.zero_grad()
            inputs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + i))
                      for i in range(microbatches)]
            losses = train_step(model, inputs)
            results.append((losses, [p.grad.clone() for p in model.parameters()]))
    finally:
        transport_module.Transport.to_host = real
    return results, bursts


@pytest.mark.parametrize("k", [1, 2, 3])
def test_bursts_span_k_layers_aligned_to_the_chunk_end_with_equal_values_and_bytes(monkeypatch, k):
    monkeypatch.setenv("MCORE_OFFLOAD_FLUSH_LAYERS", str(k))
    base, _ = _run([], layers=7)
    manager_module.reset()
    got, bursts = _run(["core_attn"], layers=7)
    for (l0, g0), (l1, g1) in zip(base, got):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    steps = get_summary().steps
    # every step offloads the same bytes, and only the last layer stays on the device
    assert len({s.total("offloaded") for s in steps}) == 1 and steps[0].total("offloaded") > 0
    assert len({s.total("kept_on_device") for s in steps}) == 1
    # step 0, first microbatch: one burst per layer (the chunk's length is not known yet); every later forward:
    # bursts at layers i = 5 and 6 (the last two) and every k-th layer below 5, each taking what is pending
    later = len({i for i in range(1, 7) if i >= 5 or (5 - i) % k == 0})
    assert bursts[0] == 6 + later
    assert bursts[1:] == [2 * later, 2 * later]
    if k > 1:
        assert later < 6


def test_the_last_burst_of_a_forward_carries_one_layer(monkeypatch):
    """What is still copying when the forward ends is one layer's groups, as with one burst per layer."""
    monkeypatch.setenv("MCORE_OFFLOAD_FLUSH_LAYERS", "4")
    sizes: list[int] = []
    real = transport_module.Transport.to_host

    def recorded(self, storages, *args, **kwargs):
        sizes.append(len(storages))
        return real(self, storages, *args, **kwargs)

    monkeypatch.setattr(transport_module.Transport, "to_host", recorded)
    model = Toy(cfg("core_attn"), layers=8)
    for _ in range(2):
        train_step(model, [torch.randn(8, 16)])
    # second step: bursts at layers 2 (layers 0-1), 6 (layers 2-5) and 7 (layer 6): the last carries one layer
    per_layer = sizes[0]
    assert sizes[7:] == [2 * per_layer, 4 * per_layer, per_layer]


@pytest.mark.parametrize("raw", ["0", "-1", "two"])
def test_a_bad_flush_layers_value_is_one_clear_sentence(monkeypatch, raw):
    monkeypatch.setenv("MCORE_OFFLOAD_FLUSH_LAYERS", raw)
    with pytest.raises(ValueError, match=r"MCORE_OFFLOAD_FLUSH_LAYERS=.* is not a positive integer; set it to 1"):
        flush_layers_from_env()


@pytest.mark.parametrize("hooks,cpp", [("0", "0"), ("1", "0"), ("1", "1")])
def test_node_hooks_and_identity_nodes_give_the_same_values_and_bytes(monkeypatch, hooks, cpp):
    """Identity nodes, node hooks registered from Python, and (where a C++ compiler and ninja are there) from C++."""
    from mcore_offload.runtime import native

    if cpp == "1" and native.toolchain_missing():  # with the tools there, MCORE_OFFLOAD_NATIVE=1 fails a bad build
        pytest.skip(f"the C++ node hooks cannot be built here: {native.toolchain_missing()}")
    monkeypatch.setenv("MCORE_OFFLOAD_NODE_HOOKS", hooks)
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", cpp)
    native.reset()
    base, _ = _run([], layers=4, steps=2)
    manager_module.reset()
    got, _ = _run(["qkv_linear", "core_attn", "attn_proj"], layers=4, steps=2)
    for (l0, g0), (l1, g1) in zip(base, got):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    last = get_summary().last_step
    assert last.total("offloaded") > 0 and last.total("reloaded") == last.total("offloaded")
    assert get_manager().node_hooks is (hooks == "1")
    assert (get_manager().native is not None) is (cpp == "1")  # the C++ case ran in C++, not a silent fallback
    assert not get_manager().handlers and get_summary().host_resident_bytes == 0


def test_node_hooks_add_no_autograd_node(monkeypatch):
    """With node hooks the graph is the plain model's: no identity node per group start or commit."""

    def graph_size(loss):
        seen, todo = set(), [loss.grad_fn]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            todo.extend(n for n, _ in node.next_functions)
        return len(seen)

    x = torch.randn(8, 16)
    sizes = {}
    for hooks in ("1", "0"):
        monkeypatch.setenv("MCORE_OFFLOAD_NODE_HOOKS", hooks)
        manager_module.reset()
        model = Toy(cfg("core_attn"), layers=3)
        loss = model(x)
        sizes[hooks] = graph_size(loss)
        loss.backward()
    plain = graph_size(Toy(cfg(), layers=3)(x))
    assert sizes["1"] == plain
    assert sizes["0"] == plain + 2 * 3  # a start and a commit node per layer


class _FakeRuntime:
    """The CUDA runtime calls RawCudaTransport.to_device makes, recorded (stream_wait: which events). The copies
    come through ``memcpy`` (the Python loop) or through the C-callable at ``memcpy_address`` (the C++ loop)."""

    memcpy_batch = None  # copies one by one

    def __init__(self):
        import ctypes

        self.waits, self.copies, self.calls = [], 0, []
        vp = ctypes.c_void_p
        self._c_memcpy = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, ctypes.c_size_t, ctypes.c_int, vp)(
            lambda dst, src, n, kind, stream: self.memcpy(dst, src, n, kind, stream))
        self.memcpy_address = ctypes.cast(self._c_memcpy, vp).value

    def event_record(self, event, stream):
        self.calls.append(("record", event))
        return 0

    def stream_wait(self, stream, event, flags):
        self.waits.append(event)
        return 0

    def memcpy(self, dst, src, n, kind, stream):
        self.copies += 1
        self.calls.append(("copy", n))
        return 0


def _raw_transport(native_impl: str):
    """A RawCudaTransport without CUDA (only what to_device touches), with the C++ or the Python copy loop."""
    from collections import deque
    from types import SimpleNamespace

    from mcore_offload.runtime import native
    from mcore_offload.runtime.raw_transport import RawCudaTransport
    from mcore_offload.runtime.telemetry import LinkTelemetry

    t = object.__new__(RawCudaTransport)
    t.rt = _FakeRuntime()
    t._held = deque()
    t.reload_seq = 0  # to_device numbers its parts' done events from it
    t._h2d_handle, t._h2d_fence = H2D, SimpleNamespace(handle="fence")
    t.telemetry = LinkTelemetry(None)
    t._compute_handle = lambda: "compute"
    t.device_index = -1  # the CPU
    t.native = native.load_native() if native_impl == "native" else None
    assert (t.native is not None) == (native_impl == "native")
    return t


H2D = 0x42  # the side stream's handle in these tests


def test_a_reload_waits_only_on_d2h_bursts_not_yet_seen_complete(hook_impl):
    from types import SimpleNamespace

    t = _raw_transport(hook_impl)
    t._done_event = lambda: SimpleNamespace(handle="done")
    seen, unseen = SimpleNamespace(handle="seen", seen_done=True), SimpleNamespace(handle="unseen", seen_done=False)
    hosts = [torch.zeros(4, dtype=torch.uint8) for _ in range(3)]
    storages, _ = t.to_device(hosts, [4, 4, 4], [seen, unseen, unseen], torch.device("cpu"))
    assert len(storages) == 3 and t.rt.copies == 3
    # the fence, then the one D2H burst not yet seen complete (once for its two storages)
    assert t.rt.waits == ["fence", "unseen"]
    # with the batch entry point, the burst's three copies are one call
    batches = []
    t.rt.memcpy_batch = True
    t.rt.memcpy_many = lambda dsts, srcs, sizes, stream: batches.append((len(dsts), sizes, stream)) or 0
    t.to_device(hosts, [4, 4, 4], [seen], torch.device("cpu"))
    assert batches == [(3, [4, 4, 4], H2D)] and t.rt.copies == 3


def test_a_reload_in_parts_records_a_done_event_after_each_part_in_order(hook_impl):
    from itertools import count
    from types import SimpleNamespace

    t = _raw_transport(hook_impl)
    n = count()
    t._done_event = lambda: SimpleNamespace(handle=f"done{next(n)}")
    hosts = [torch.zeros(8, dtype=torch.uint8) for _ in range(3)]
    _, events = t.to_device(hosts, [1, 2, 3], [None], torch.device("cpu"), [1, 2])
    assert [e.handle for e in events] == ["done0", "done1"]
    assert t.rt.calls == [("record", "fence"), ("copy", 1), ("record", "done0"), ("copy", 2), ("copy", 3),
                          ("record", "done1")]
    with pytest.raises(ValueError, match="do not split 3 copies"):
        t.to_device(hosts, [1, 2, 3], [None], torch.device("cpu"), [1, 1])


def test_batch_copy_passes_every_pointer_size_and_the_stream_order_attribute():
    """memcpy_many's ctypes arguments, read back by a C-callable stand-in for cudaMemcpyBatchAsync."""
    import ctypes

    from mcore_offload.runtime import cudart

    seen = {}

    def fake(dsts, srcs, sizes, count, attrs, attr_index, num_attrs, stream):
        seen.update(dsts=[dsts[i] for i in range(count)], srcs=[srcs[i] for i in range(count)],
                    sizes=[sizes[i] for i in range(count)], order=attrs.contents.src_access_order,
                    index=attr_index[0], num_attrs=num_attrs, stream=stream)
        return 0

    callback = ctypes.CFUNCTYPE(ctypes.c_int, *cudart.BATCH_ARGTYPES)(fake)
    rt = object.__new__(cudart.CudaRuntime)
    rt.memcpy_batch = callback
    rt._batch_attrs = cudart.MemcpyAttributes(cudart.MEMCPY_SRC_ACCESS_ORDER_STREAM)
    rt._batch_attr_index = (ctypes.c_size_t * 1)(0)
    assert rt.memcpy_many([0x1000, 0x2000], [0x3000, 0x4000], [16, 1 << 33], 0x77) == 0
    assert seen == {"dsts": [0x1000, 0x2000], "srcs": [0x3000, 0x4000], "sizes": [16, 1 << 33], "order": 1,
                    "index": 0, "num_attrs": 1, "stream": 0x77}
    assert ctypes.sizeof(cudart.MemcpyAttributes) == 24  # the C struct's size (enum, two locations, flags)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_reload_bursts_span_k_layers_after_the_first_and_one_wait_covers_each(monkeypatch, k):
    """Backward's reloads: the chunk's first burst brings one layer back, later ones k layers, each layer with its
    own done event, which that layer's backward waits for (not the whole burst's). Same values, same bytes."""
    monkeypatch.setenv("MCORE_OFFLOAD_RELOAD_LAYERS", str(k))
    sizes: list[int] = []
    parts: list[list[int] | None] = []
    waits: list[int] = []
    real_to_device, real_wait = transport_module.Transport.to_device, transport_module.Transport.wait

    def recorded(self, hosts, sizes_, after, device, parts_=None):
        sizes.append(len(hosts))
        parts.append(parts_)
        return real_to_device(self, hosts, sizes_, after, device, parts_)

    def waited(self, event):
        waits.append(1)
        return real_wait(self, event)

    base, _ = _run([], layers=7, steps=2, microbatches=1)
    manager_module.reset()
    monkeypatch.setattr(transport_module.Transport, "to_device", recorded)
    monkeypatch.setattr(transport_module.Transport, "wait", waited)
    got, _ = _run(["core_attn"], layers=7, steps=2, microbatches=1)
    for (l0, g0), (l1, g1) in zip(base, got):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    last = get_summary().last_step
    assert last.total("reloaded") == last.total("offloaded") > 0
    assert last.total("reloaded_on_demand") == 0  # every reload was a prefetch
    # layers 1-6 leave the device (the 7th stays); per step, bursts in layers: 6, then 5..1 in runs of k
    per_step = len(sizes) // 2
    per_layer = sizes[0]
    expected = [1] + [min(k, 5 - i) for i in range(0, 5, k)]
    assert [n // per_layer for n in sizes[:per_step]] == expected
    assert sizes[per_step:] == sizes[:per_step]
    # a part per layer in a burst of several; one wait per layer
    assert [p or [n] for p, n in zip(parts, sizes)][:per_step] == [[per_layer] * (n // per_layer)
                                                                    for n in sizes[:per_step]]
    assert len(waits) == 2 * 6


def test_a_bad_reload_layers_value_is_one_clear_sentence(monkeypatch):
    monkeypatch.setenv("MCORE_OFFLOAD_RELOAD_LAYERS", "0")
    with pytest.raises(ValueError, match=r"MCORE_OFFLOAD_RELOAD_LAYERS=.* is not a positive integer; set it to 1"):
        reload_layers_from_env()


@points_step_boundary
def _forward_all_then_backward(model, inputs):
    """Every microbatch's forward, then the backwards, last first: only the last microbatch turns around."""
    losses = [model(x) for x in inputs]
    for loss in reversed(losses):
        loss.backward()
    return [loss.detach() for loss in losses]


def steps_forward_all_then_backward(model, steps=2, microbatches=2):
    """Losses and gradients of ``steps`` steps of :func:`_forward_all_then_backward`."""
    return toy_steps(model, steps, microbatches, _forward_all_then_backward)


@pytest.mark.parametrize("mode", ["layer", "tail", "late"])
def test_prefetch_mode_sets_when_the_layer_below_comes_back_with_equal_values(monkeypatch, mode):
    """MCORE_OFFLOAD_PREFETCH: ``layer`` reloads the layer below when a layer's backward starts; ``late`` when it is
    done; ``tail`` late only in the last layer of a chunk that did not turn around (under PP, where the peak is)."""
    from mcore_offload.runtime.handler import ChunkOffloadHandler

    def values(names):
        return steps_forward_all_then_backward(Toy(cfg(*names), layers=4))

    base = values([])
    # the points' Python glue, whose hooks call the handler's method recorded below (the C++ hooks of
    # points_block.cpp call backward.cpp directly)
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "0")
    manager_module.reset()
    monkeypatch.setenv("MCORE_OFFLOAD_PREFETCH", mode)
    seen: list[tuple[int, int, bool, bool]] = []  # (microbatch, layer, kept, layer below resident) at each done
    real = ChunkOffloadHandler.on_group_backward_done

    def recorded(self, group):
        below = [e for g in self.groups if g.layer == group.layer - 1 for e in g.entries]
        seen.append((self.microbatch, group.layer, self.groups[-1].kept_on_device,
                     any(e.device_storage is not None for e in below)))
        return real(self, group)

    monkeypatch.setattr(ChunkOffloadHandler, "on_group_backward_done", recorded)
    got = values(["core_attn"])
    for (l0, g0), (l1, g1) in zip(base, got):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1)) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    for mb, layer, kept, resident in seen:
        if layer == 1:  # layers count from 1; the first has none below
            continue
        late = mode == "late" or (mode == "tail" and layer == 4 and not kept)
        assert resident == (not late), (mb, layer, kept, mode)
    # microbatch 0 did not turn around (microbatch 1 ran in between); microbatch 1 did
    assert {(mb, kept) for mb, layer, kept, _ in seen} == {(0, False), (1, True)}


@pytest.mark.parametrize("mode", ["layer", "late"])
def test_a_late_reload_gives_each_group_its_own_done_event_and_wait(monkeypatch, mode, hook_impl):
    """Two groups a layer (``qkv_linear`` and ``attn_proj``, not chained). A late reload of the layer below starts
    right before that layer's backward: it comes in one part per group, so the first group's backward waits for its
    own copies only (its entries carry an earlier burst number than the second group's). Ahead of time (``layer``)
    a layer still comes back as one part. Same values either way."""
    from mcore_offload.runtime.handler import ChunkOffloadHandler

    names = ["qkv_linear", "attn_proj"]
    base, _ = _run([], layers=4, steps=2, microbatches=1)
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "0")  # hooks that call the method recorded below
    manager_module.reset()
    monkeypatch.setenv("MCORE_OFFLOAD_PREFETCH", mode)
    parts: list[list[int] | None] = []
    real_to_device = transport_module.Transport.to_device

    def recorded(self, hosts, sizes_, after, device, parts_=None):
        parts.append(parts_)
        return real_to_device(self, hosts, sizes_, after, device, parts_)

    first_wait: list[tuple[int, int]] = []  # at each layer's first group backward: (its burst, the layer's last)
    real_commit = ChunkOffloadHandler.on_group_commit_backward

    def commit_backward(self, group=None):
        real_commit(self, group)
        if group is not None and group.entries and group.name == "attn_proj" and group.layer > 1:
            layer = [e for g in self.groups if g.layer == group.layer for e in g.entries]
            first_wait.append((max(e.h2d_seq for e in group.entries), max(e.h2d_seq for e in layer)))

    monkeypatch.setattr(transport_module.Transport, "to_device", recorded)
    monkeypatch.setattr(ChunkOffloadHandler, "on_group_commit_backward", commit_backward)
    got, _ = _run(names, layers=4, steps=2, microbatches=1)
    for (l0, g0), (l1, g1) in zip(base, got):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    last = get_summary().last_step
    assert last.total("reloaded") == last.total("offloaded") > 0
    split = [p for p in parts if p and len(p) == 2]
    if mode == "late":
        assert split and first_wait and all(own < layer_last for own, layer_last in first_wait)
    else:
        assert not split


def test_a_bad_prefetch_value_is_one_clear_sentence(monkeypatch):
    monkeypatch.setenv("MCORE_OFFLOAD_PREFETCH", "early")
    with pytest.raises(ValueError, match=r"MCORE_OFFLOAD_PREFETCH='early' is not one of layer, tail, late; unset it"):
        manager_module.OffloadManager()


def test_a_bad_second_look_value_is_one_clear_sentence(monkeypatch):
    monkeypatch.setenv("MCORE_OFFLOAD_SECOND_LOOK", "off")
    with pytest.raises(ValueError, match=r"MCORE_OFFLOAD_SECOND_LOOK='off' is not one of 0, 1; unset it"):
        manager_module.OffloadManager()
