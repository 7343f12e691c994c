"""The runtime's per-burst, per-wait and per-layer Python in C++ against the Python it stands for:

- ``link_calls.cpp``: the compute stream's wait on a reload (``Transport.wait_reload`` with ``RawCudaTransport.wait``,
  its arrival mark and stall span) makes the same CUDA calls, in the same order, with the same events, on the logging
  stub runtime (``benchmarks/cpu_transport_glue.py``);
- ``event_type.cpp``: the C++ module's event type holds and returns its handle as ``cudart.RawEvent`` does;
- ``layer_boundary.cpp``: training steps flush at the same layers and count the same bytes as
  ``OffloadManager.layer_boundary`` (``MCORE_OFFLOAD_NATIVE_POINTS=0``), losses and gradients bit for bit.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from mcore_offload.runtime import cudart, native
from mcore_offload.runtime import transport as transport_module
from mcore_offload.runtime.manager import get_manager, reset
from mcore_offload.summary import get_summary
from tests.test_runtime_unit import Toy, cfg, toy_steps

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cpu_transport_glue  # noqa: E402


def _waits(rt, use_cpp: bool):
    """Three waits of the compute stream on reload bursts (one already covered by a later one) in a timed step: the
    stub's call log, the step's spans (kind, whether it has a start mark, its end's handle) and the waited numbers."""
    t = cpu_transport_glue.stub_transport(rt, -1, native=True, timed_from_start=True)
    t.cpp_bursts = use_cpp
    assert t.native.bursts_in_cpp(t) is use_cpp
    pool = t._timed_events
    events = [pool.get() for _ in range(3)]
    for event, stream in zip(events, (2, 2, 2)):
        event.record(stream)
    cpu_transport_glue.stub_calls(rt)  # clear
    wait = (lambda e, s: t.native.wait_reload(t, e, s)) if use_cpp else t.wait_reload
    wait(events[1], 2)
    wait(events[0], 1)  # covered by burst 2's wait: no call
    wait(events[2], 3)
    wait(None, 4)  # a burst number without an event: counted, nothing to wait on
    spans = [(kind, start is not None, end.handle, n, keep) for kind, start, end, n, keep in t.telemetry._current.spans]
    return cpu_transport_glue.stub_calls(rt), spans, dict(t._waited_seq)


def test_the_cpp_reload_wait_makes_the_python_waits_calls(native_stub_runtime):
    cpp, python = _waits(native_stub_runtime, True), _waits(native_stub_runtime, False)
    assert cpp == python
    calls, spans, waited = cpp
    # per wait: the arrival mark recorded on the compute stream (3), then the compute stream's wait on the burst
    assert [c[0] for c in calls] == ["record", "wait", "record", "wait"]
    assert [s[0] for s in spans] == ["stall", "stall"] and all(s[1] and s[4] for s in spans)
    assert waited == {3: 4}


def test_an_untimed_step_waits_without_marks_either_way(native_stub_runtime):
    for use_cpp in (True, False):
        t = cpu_transport_glue.stub_transport(native_stub_runtime, -1, native=True, timed_from_start=False)
        t.cpp_bursts = use_cpp
        event = t._timed_events.get()
        cpu_transport_glue.stub_calls(native_stub_runtime)
        (lambda e, s: t.native.wait_reload(t, e, s))(event, 1) if use_cpp else t.wait_reload(event, 1)
        assert [c[0] for c in cpu_transport_glue.stub_calls(native_stub_runtime)] == ["wait"]
        assert [(k, s) for k, s, *_ in t.telemetry._current.spans] == [("stall", None)]


def test_the_cpp_event_type_returns_its_handle_as_the_python_one(native_stub_runtime):
    module = native.load_native()
    kind = cudart.native_event_type(module)
    assert cudart.native_event_type(module) is kind  # one class per loaded module
    for make in (kind, cudart.RawEvent):
        free: list[int] = []
        event = make(native_stub_runtime, 41, free)
        assert (event.handle, event.seen_done, event.reload_seq, event._free) == (41, False, None, free)
        event.seen_done, event.reload_seq = True, 7
        assert (event.seen_done, event.reload_seq) == (True, 7)
        cpu_transport_glue.stub_calls(native_stub_runtime)
        event.record(5)
        assert cpu_transport_glue.stub_calls(native_stub_runtime) == [("record", 41, 5)]
        assert event.query() is True
        del event
        gc.collect()
        assert free == [41]
    with pytest.raises(TypeError):
        kind(native_stub_runtime, 1, "not a list")
    with pytest.raises(AttributeError):
        kind(native_stub_runtime, 1, []).other = 1  # no instance dict, as RawEvent's slots


def test_the_raw_transports_pool_hands_out_the_cpp_events(native_stub_runtime):
    t = cpu_transport_glue.stub_transport(native_stub_runtime, -1, native=True, timed_from_start=True)
    data = [torch.ones(8, dtype=torch.uint8)]
    _, done = t.to_host([d.untyped_storage() for d in data], data, [None])
    assert type(done) is cudart.native_event_type(t.native)
    handle = done.handle
    t._held.clear()
    t.telemetry.clear()
    del done
    gc.collect()
    assert handle in t._timed_events.free  # back for the next burst


def _flushes(monkeypatch, native_points: bool, names, layers=6, steps=3):
    """Training steps of the toy model; the layer count of the forward chunk at each copy-out burst, and the steps'
    counters and results."""
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "1" if native_points else "0")
    monkeypatch.setenv("MCORE_OFFLOAD_FLUSH_LAYERS", "2")
    reset()
    at: list[int] = []
    to_host = transport_module.Transport.to_host

    def recorded(self, *args):
        handler = get_manager().forward_handler
        at.append(handler.layers if handler is not None else -1)
        return to_host(self, *args)

    monkeypatch.setattr(transport_module.Transport, "to_host", recorded)
    result = toy_steps(Toy(cfg(*names), layers=layers), steps, 2)
    counters = [{p: dict(c) for p, c in s.points.items()} for s in get_summary().steps]
    monkeypatch.undo()
    return at, counters, result


@pytest.mark.parametrize("names", [["qkv_linear", "core_attn", "attn_proj"], ["core_attn"]])
def test_the_cpp_layer_boundary_flushes_at_the_same_layers(monkeypatch, names):
    if native.toolchain_missing():
        pytest.skip(f"the C++ hooks cannot be built here: {native.toolchain_missing()}")
    native.reset()
    assert native.load_native() is not None
    try:
        cpp, python = _flushes(monkeypatch, True, names), _flushes(monkeypatch, False, names)
    finally:
        native.reset()
        reset()
    assert cpp[0] == python[0] and cpp[1] == python[1]
    for (l0, g0), (l1, g1) in zip(cpp[2], python[2], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    # the first forward flushes at every layer; later ones at every second layer, aligned to the chunk's end (six
    # layers: at the starts of layers 3 and 5, and 6, the last)
    assert cpp[0][:5] == [2, 3, 4, 5, 6] and cpp[0][-3:] == [3, 5, 6]
