"""The raw transport's copy bursts in C++ (``runtime/native/bursts.cpp``) against its Python methods: on the logging
stub CUDA runtime (``benchmarks/cpu_transport_glue.py``) both make the same CUDA calls in the same order, with the
same events, and hand back the same bytes, buffers, burst numbers and telemetry spans. ``tests/test_stream_order.py``
checks the hand-offs of both in training steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mcore_offload.runtime import cudart

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cpu_transport_glue  # noqa: E402

CPU = torch.device("cpu")


def _transport(rt, use_cpp: bool):
    t = cpu_transport_glue.stub_transport(rt, -1, native=True, timed_from_start=True)
    assert t.native is not None and hasattr(t.native, "to_host_burst")
    if not use_cpp:
        t.cpp_bursts = False  # the Python methods, with the same C++ module for the rest
    assert (t._native_bursts() is not None) == use_cpp
    return t


def _script(t, rt):
    """Copy-outs, reloads in parts, buffer reuse with and without the compute stream's wait, a reload after a D2H
    not seen complete. Returns what each call answered and the stub's call log."""
    cpu_transport_glue.stub_calls(rt)  # clear
    data = [torch.full((n,), i + 1, dtype=torch.uint8) for i, n in enumerate((16, 32, 8))]
    bufs, done = t.to_host([d.untyped_storage() for d in data], data, [None, "expert_fc1", None])
    held_after_copy = len(t._held)
    t.release_copied()
    t.reload_seq = 5
    back, events = t.to_device(bufs, [16, 32, 8], [done] * 3, CPU, parts=[1, 2])
    t.reload_seq += 2
    t.wait_reload(events[1], 7)
    for b, e in zip(bufs, (events[0], events[1], events[1])):
        t.release_host(b, e)
    more = [torch.full((n,), 7 + i, dtype=torch.uint8) for i, n in enumerate((16, 32, 8))]
    bufs2, done2 = t.to_host([d.untyped_storage() for d in more], more, [None, "expert_fc1", None])
    host_copies = [bytes(b[:n]) for b, n in zip(bufs2, (16, 32, 8))]
    for b, e in zip(bufs2, (events[0], events[1], events[1])):
        t.release_host(b, e)
    # reuse without the compute stream's wait: the D2H waits on the reload itself
    t.reload_seq = 9
    _, late_events = t.to_device(bufs2[:1], [16], [None], CPU)
    t.release_host(bufs2[0], late_events[0])
    bufs3, _ = t.to_host([data[0].untyped_storage()], [data[0]], [None])
    unseen = cudart.RawEvent(rt, 77, [])
    back2, events2 = t.to_device(bufs3, [16], [unseen], CPU)
    # the pool's other answers: a free buffer of a larger class (searched), a routed request its buffers do not fit
    big, small, routed_big = (torch.full((n,), v, dtype=torch.uint8) for n, v in ((5000, 5), (4500, 6), (1000, 4)))
    got_big, _ = t.to_host([big.untyped_storage()], [big], [None])
    t.release_host(got_big[0], None)
    got_small, _ = t.to_host([small.untyped_storage()], [small], [None])
    got_routed, _ = t.to_host([routed_big.untyped_storage()], [routed_big], ["expert_fc1"])
    answers = {
        "held_after_copy": held_after_copy,
        "buffers": [[next((i for i, x in enumerate(bufs) if x is b), -1) for b in group] for group in (bufs2, bufs3)],
        "back": [bytes(torch.empty(0, dtype=torch.uint8).set_(s)) for s in back + back2],
        "reload_seq": [e.reload_seq for e in events + late_events + events2],
        "seen": done.seen_done,
        "last_h2d": t._last_h2d_done is events2[-1],
        "spans": [(kind, nbytes, keep) for kind, _, _, nbytes, keep in t.telemetry._current.spans],
        "host_copies": host_copies,
        "searched": got_small[0] is got_big[0] and got_small[0].numel() == 5120,
        "routed_grew": got_routed[0].numel() >= 1000 and t.pool._routed_largest["expert_fc1"] == 1000,
        "allocations": t.pool.allocations,
    }
    calls = [(c[0], *c[3:]) if c[0] == "copy" else c for c in cpu_transport_glue.stub_calls(rt)]  # no addresses
    return answers, calls


def test_the_cpp_bursts_make_the_python_bursts_calls_and_answers(native_stub_runtime):
    py_answers, py_calls = _script(_transport(native_stub_runtime, use_cpp=False), native_stub_runtime)
    cpp_answers, cpp_calls = _script(_transport(native_stub_runtime, use_cpp=True), native_stub_runtime)
    assert cpp_calls == py_calls
    assert cpp_answers == py_answers
    # the script covers what it means to: skipped and made reuse waits, a seen D2H, one wait per unseen one
    assert py_answers["seen"] and py_answers["reload_seq"] == [6, 7, 10, 10]
    assert py_answers["searched"] and py_answers["routed_grew"]
    d2h_waits = [c for c in py_calls if c[0] == "wait" and c[1] == 1]
    h2d_waits = [c for c in py_calls if c[0] == "wait" and c[1] == 2]
    assert len(d2h_waits) == 7  # six fences and one reuse wait (the burst the compute stream never waited for)
    assert ("wait", 2, 77) in h2d_waits and len(h2d_waits) == 4  # three fences and the unseen D2H
    assert py_answers["back"][:3] == [bytes([1] * 16), bytes([2] * 32), bytes([3] * 8)]
    assert py_answers["host_copies"] == [bytes([7] * 16), bytes([8] * 32), bytes([9] * 8)]


def test_bad_reload_parts_are_one_sentence_on_both_paths(native_stub_runtime):
    host = [torch.zeros(4, dtype=torch.uint8)] * 2
    for use_cpp in (False, True):
        t = _transport(native_stub_runtime, use_cpp)
        with pytest.raises(ValueError, match=r"reload parts \[1, 2\] do not split 2 copies into non-empty runs"):
            t.to_device(host, [4, 4], [None, None], CPU, parts=[1, 2])


def test_the_cpp_bursts_step_aside_where_python_must_make_them(native_stub_runtime, monkeypatch):
    """The C++ copy-out, reload and wait paths go straight to the C++ bursts where ``_native_bursts`` would, and
    nowhere else: ``bursts_in_cpp`` reads the same conditions."""
    t = _transport(native_stub_runtime, use_cpp=True)
    both = lambda: (t._native_bursts() is not None, t.native.bursts_in_cpp(t))  # noqa: E731
    assert both() == (True, True)
    t.cpp_bursts = False
    assert both() == (False, False)  # the switch for comparisons
    t.cpp_bursts = True
    t.coalesce = True
    assert both() == (False, False)  # coalesced reloads
    t.coalesce = False
    monkeypatch.setattr(t.rt, "memcpy_batch", object())
    assert both() == (False, False)  # one cudaMemcpyBatchAsync a burst
    monkeypatch.setattr(t.rt, "memcpy_batch", None)
    monkeypatch.setattr(t.rt, "call_addresses", None)
    assert both() == (False, False)  # a runtime without C entry points (tests' fakes)
    native = t.native
    t.native = None
    assert t._native_bursts() is None and native.bursts_in_cpp(t) is False
    assert native.bursts_in_cpp(object()) is False  # not a raw transport


def test_the_burst_phase_clock_counts_bursts_and_copies_then_resets(native_stub_runtime):
    """burst_timing (benchmarks/runtime_breakdown.py reads it): off, it counts nothing; on, one burst per call, its
    copies, a time for every phase the burst went through; reading it resets it."""
    t = _transport(native_stub_runtime, use_cpp=True)
    native = t.native
    native.burst_timing(False)
    data = [torch.ones(8, dtype=torch.uint8) for _ in range(3)]
    t.to_host([d.untyped_storage() for d in data], data, [None] * 3)
    assert native.burst_timing(True)["to_host"]["bursts"] == 0  # it was off
    bufs, done = t.to_host([d.untyped_storage() for d in data], data, [None] * 3)
    t.to_device(bufs, [8, 8, 8], [done] * 3, CPU, parts=[2, 1])
    got = native.burst_timing(False)
    assert got["to_host"]["bursts"] == 1 and got["to_host"]["copies"] == 3
    assert got["to_device"]["bursts"] == 1 and got["to_device"]["copies"] == 3
    assert all(ns >= 0 for row in got.values() for ns in row["ns"].values())
    assert got["to_host"]["ns"]["copies"] > 0 and got["to_device"]["ns"]["alloc"] > 0
    assert got["to_host"]["ns"]["alloc"] == 0  # a copy-out allocates on the host, through the pool ("acquire")
    assert native.burst_timing(False)["to_host"]["bursts"] == 0  # read and reset


def _bursts_behind_a_slow_link(t, rt, limit: int):
    """Four copy-outs while no event completes (``limit``: MCORE_OFFLOAD_D2H_IN_FLIGHT), then a chunk's end; returns
    what was held after each burst, the done events, the waits the compute stream (handle 3) made and the counter."""
    t.d2h_in_flight = limit
    t.telemetry.timing = False  # untimed: no marks, so the log holds only the hand-offs
    cpu_transport_glue.stub_calls(rt)
    cpu_transport_glue.stub_set_busy(rt, True)
    try:
        data = [torch.full((8,), i, dtype=torch.uint8) for i in range(4)]
        held, dones = [], []
        for d in data:
            dones.append(t.to_host([d.untyped_storage()], [d], [None])[1])
            held.append(len(t._held))
        before_end = cpu_transport_glue.stub_calls(rt)
        if limit:
            t.release_copied(final=True)
        end = cpu_transport_glue.stub_calls(rt)
    finally:
        cpu_transport_glue.stub_set_busy(rt, False)
    waits = [c[2] for c in before_end if c[0] == "wait" and c[1] == 3]
    end_waits = [c[2] for c in end if c[0] == "wait" and c[1] == 3]
    return held, [e.handle for e in dones], waits, end_waits, len(t._held), t.in_flight_waits, before_end


@pytest.mark.parametrize("use_cpp", [False, True])
def test_a_bound_on_bursts_in_flight_makes_the_compute_stream_wait_for_the_oldest(native_stub_runtime, use_cpp):
    """MCORE_OFFLOAD_D2H_IN_FLIGHT=2 behind a link that never catches up: from the third burst on, the compute stream
    waits for the burst two back before the new one is queued, and the device blocks of that burst are let go; at a
    chunk's end it waits for the newest, and nothing stays held. Unbounded (0): no wait, every burst held."""
    t = _transport(native_stub_runtime, use_cpp)
    held, dones, waits, end_waits, left, counted, _ = _bursts_behind_a_slow_link(t, native_stub_runtime, 2)
    assert held == [1, 2, 2, 2]
    assert waits == [dones[0], dones[1]]  # before bursts 3 and 4
    assert end_waits == [dones[3]] and left == 0 and counted == 3
    t = _transport(native_stub_runtime, use_cpp)
    held, _, waits, _, left, counted, _ = _bursts_behind_a_slow_link(t, native_stub_runtime, 0)
    assert held == [1, 2, 3, 4] and waits == [] and left == 4 and counted == 0
    t._held.clear()


def test_the_bound_makes_the_same_calls_in_python_and_cpp(native_stub_runtime):
    got = [_bursts_behind_a_slow_link(_transport(native_stub_runtime, use_cpp), native_stub_runtime, 1)
           for use_cpp in (False, True)]
    assert got[0][0] == got[1][0] == [1, 1, 1, 1]
    calls = [[(c[0], *c[3:]) if c[0] == "copy" else c for c in g[-1]] for g in got]
    assert calls[0] == calls[1]
    # each wait comes before the fence of the burst it makes room for: the new burst is queued after it
    waits = [i for i, c in enumerate(calls[0]) if c[0] == "wait" and c[1] == 3]
    fences = [i for i, c in enumerate(calls[0]) if c[0] == "record" and c[2] == 3]
    assert len(waits) == 3 and all(f > w for w, f in zip(waits, fences[1:]))


def test_a_bad_bound_is_one_clear_sentence(monkeypatch):
    from mcore_offload.runtime.transport import d2h_in_flight_from_env

    monkeypatch.setenv("MCORE_OFFLOAD_D2H_IN_FLIGHT", "-1")
    with pytest.raises(ValueError, match=r"^MCORE_OFFLOAD_D2H_IN_FLIGHT='-1' is not a non-negative integer; set N"):
        d2h_in_flight_from_env()
    monkeypatch.setenv("MCORE_OFFLOAD_D2H_IN_FLIGHT", "two")
    with pytest.raises(ValueError, match="is not a non-negative integer"):
        d2h_in_flight_from_env()
    monkeypatch.setenv("MCORE_OFFLOAD_D2H_IN_FLIGHT", "3")
    assert d2h_in_flight_from_env() == 3
    monkeypatch.delenv("MCORE_OFFLOAD_D2H_IN_FLIGHT")
    assert d2h_in_flight_from_env() == 0
