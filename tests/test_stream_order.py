"""Every hand-off between streams, checked from the CUDA calls themselves: the raw transport runs training steps on a
stub CUDA runtime that logs each event record, cross-stream wait, event query and copy (``benchmarks/
cpu_transport_glue.py``), and a happens-before replay of that log (``tests/harness/stream_order.py``: vector clocks
over the three streams) asserts

- a D2H copy into a host buffer comes after every H2D copy that read that buffer before (buffer reuse), and
- an H2D copy from a host buffer comes after the D2H copy that filled it (upstream bug #7398).

An event the stub answered complete to a query orders everything issued after the query: that is what the runtime
may rely on (``seen_done``). The checker itself is tested on a log with one wait removed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_runtime_unit import Toy, cfg, toy_steps, train_step

from mcore_offload.runtime import manager as manager_module
from mcore_offload.runtime import transport as transport_module
from tests.harness.stream_order import D2H, H2D, hazards, host_ranges, reuse_waits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cpu_transport_glue  # noqa: E402

pytestmark = pytest.mark.usefixtures("hook_impl")


def test_the_checker_finds_a_missing_wait():
    """Buffer reuse: H2D reads B, compute waits for it, fence, D2H writes B (fine); without the compute's wait, not."""
    base = [("copy", 0x100, 0x5000, 64, D2H, 1), ("record", 50, 1), ("wait", 2, 50),
            ("copy", 0x5000, 0x100, 64, H2D, 2), ("record", 51, 2)]
    tail = [("record", 8, 3), ("wait", 1, 8), ("copy", 0x100, 0x6000, 64, D2H, 1)]
    assert hazards(base + [("wait", 3, 51)] + tail, [(0x100, 0x200)]) == []
    assert hazards(base + tail, [(0x100, 0x200)]) == ["D2H into 0x100 not ordered after the H2D that read it"]
    assert hazards([("copy", 0x5000, 0x100, 64, H2D, 2)], [(0x100, 0x200)]) == [
        "H2D from 0x100 not ordered after the D2H that filled it"]
    # a query that saw the D2H's event complete orders the H2D issued after it
    assert hazards(base[:2] + [("query", 50), ("copy", 0x5000, 0x100, 64, H2D, 2)], [(0x100, 0x200)]) == []


@pytest.fixture(scope="module")
def logging_runtime(tmp_path_factory):
    if cpu_transport_glue.compiler() is None:
        pytest.skip("no C compiler for the stub CUDA runtime")
    return cpu_transport_glue.stub_runtime(tmp_path_factory.mktemp("stub"), real_copies=True, log=True)


@pytest.mark.parametrize("names, flush_layers", [(["core_attn"], "2"), (["qkv_linear", "core_attn", "attn_proj"], "1"),
                                                 (["qkv_linear", "core_attn", "attn_proj"], "2")])
def test_every_host_buffer_hand_off_is_ordered_by_events(monkeypatch, logging_runtime, names, flush_layers):
    monkeypatch.setenv("MCORE_OFFLOAD_FLUSH_LAYERS", flush_layers)
    manager_module.reset()
    rt = logging_runtime
    t = cpu_transport_glue.stub_transport(rt, -1, native=True, timed_from_start=True)
    transport_module._TRANSPORTS[torch.device("cpu")] = t
    cpu_transport_glue.stub_calls(rt)  # start from an empty log
    model = Toy(cfg(*names), layers=6)
    for step in range(4):
        model.zero_grad()
        train_step(model, [torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + i))
                           for i in range(3)])
    calls = cpu_transport_glue.stub_calls(rt)
    host = host_ranges(t)
    copies = [c for c in calls if c[0] == "copy"]
    assert host and len(copies) > 50 and any(c[4] == H2D for c in copies)
    assert hazards(calls, host) == []
    # the buffer-reuse waits that the compute stream's own reload waits already imply are not made (one a group)
    assert reuse_waits(calls, t) == 0
    from mcore_offload.summary import get_summary

    assert "copy-out bound" not in get_summary().table()  # no bound unless MCORE_OFFLOAD_D2H_IN_FLIGHT is set


def _behind_a_busy_link(monkeypatch, rt, variable, value, steps=3, microbatches=2):
    """The attention set's toy steps with ``variable=value`` on the stub runtime, every event query answered "not
    ready" (a link that never finishes): asserts the losses and gradients equal the run without offloading, every
    host-buffer hand-off ordered and nothing left held; returns the transport and the compute stream's waits for
    copy-out bursts."""
    names = ["qkv_linear", "core_attn", "attn_proj"]
    base = toy_steps(Toy(cfg(), layers=6), steps=steps, microbatches=microbatches)
    monkeypatch.setenv(variable, value)
    manager_module.reset()
    t = cpu_transport_glue.stub_transport(rt, -1, native=True, timed_from_start=True)
    transport_module._TRANSPORTS[torch.device("cpu")] = t
    cpu_transport_glue.stub_calls(rt)
    cpu_transport_glue.stub_set_busy(rt, True)
    try:
        got = toy_steps(Toy(cfg(*names), layers=6), steps=steps, microbatches=microbatches)
    finally:
        cpu_transport_glue.stub_set_busy(rt, False)
    calls = cpu_transport_glue.stub_calls(rt)
    for (l0, g0), (l1, g1) in zip(base, got):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert hazards(calls, host_ranges(t)) == []
    assert not t._held
    d2h_done = {c[1] for c in calls if c[0] == "record" and c[2] == t._d2h_handle}
    return t, [c for c in calls if c[0] == "wait" and c[1] == 3 and c[2] in d2h_done]


@pytest.mark.parametrize("limit", ["1", "2"])
def test_a_bound_on_bursts_in_flight_behind_a_slow_link_keeps_the_hand_offs_and_the_numbers(monkeypatch,
                                                                                          logging_runtime, limit):
    """MCORE_OFFLOAD_D2H_IN_FLIGHT with no event ever seen complete: the compute stream waits for copy-out bursts in
    the forward and at each chunk's end, and no block goes back through ``record_stream`` (the CPU tensors here would
    refuse it)."""
    t, compute_waits = _behind_a_busy_link(monkeypatch, logging_runtime, "MCORE_OFFLOAD_D2H_IN_FLIGHT", limit)
    assert t.d2h_in_flight == int(limit)
    assert t.in_flight_waits > 6 and len(compute_waits) == t.in_flight_waits  # more than one a forward
    from mcore_offload.summary import get_summary

    table = get_summary().table()
    assert (f"copy-out bound: {limit} burst(s) in flight (MCORE_OFFLOAD_D2H_IN_FLIGHT), {t.in_flight_waits} waits"
            in table)


def test_waiting_at_forward_ends_only_keeps_the_hand_offs_and_the_numbers(monkeypatch, logging_runtime):
    """MCORE_OFFLOAD_FORWARD_END=wait behind a link that never finishes: no wait inside a forward, one wait of the
    compute stream for the copy-out at each microbatch's forward end, and nothing handed to the allocator."""
    t, compute_waits = _behind_a_busy_link(monkeypatch, logging_runtime, "MCORE_OFFLOAD_FORWARD_END", "wait",
                                           steps=3, microbatches=2)
    assert t.d2h_in_flight == 0 and t.wait_at_forward_end
    assert t.in_flight_waits == 3 * 2 == len(compute_waits)
    from mcore_offload.summary import get_summary

    table = get_summary().table()
    assert "copy-out bound" not in table
    assert f"copy-out waited for at forward ends (MCORE_OFFLOAD_FORWARD_END=wait), {t.in_flight_waits} waits" in table


def test_a_bad_forward_end_choice_is_one_sentence(monkeypatch):
    monkeypatch.setenv("MCORE_OFFLOAD_FORWARD_END", "late")
    with pytest.raises(ValueError, match=r"MCORE_OFFLOAD_FORWARD_END='late' is not one of hand-over, wait; set wait"):
        manager_module.reset()
        manager_module.get_manager()


def test_a_reused_buffer_waits_for_its_reload_unless_the_compute_stream_already_did(logging_runtime):
    """The skipped buffer-reuse wait relies on the compute stream having waited for that reload burst (or a later
    one): where it has not (a step that failed before the group's backward), the D2H still waits itself."""
    rt = logging_runtime
    t = cpu_transport_glue.stub_transport(rt, -1, native=True, timed_from_start=True)
    cpu_transport_glue.stub_calls(rt)
    first = torch.arange(64, dtype=torch.uint8)
    bufs, _ = t.to_host([first.untyped_storage()], [first], [None])
    t.release_copied()  # the host sees that copy complete: the reload below may skip its wait on it
    _, events = t.to_device(bufs, [64], [None], torch.device("cpu"))
    t.reload_seq += 1  # as the handler numbers the burst
    assert events[0].reload_seq == t.reload_seq
    t.release_host(bufs[0], events[0])  # the compute stream never waited for this reload
    second = torch.zeros(64, dtype=torch.uint8)
    again, _ = t.to_host([second.untyped_storage()], [second], [None])
    assert again[0].data_ptr() == bufs[0].data_ptr()  # the same buffer, reused
    calls = cpu_transport_glue.stub_calls(rt, clear=False)
    host = [(bufs[0].data_ptr(), bufs[0].data_ptr() + bufs[0].numel())]
    assert ("wait", t._d2h_handle, events[0].handle) in calls and hazards(calls, host) == []
    seen = len(calls)
    # once the compute stream has waited for that burst, the fence it records orders the next D2H: no wait
    t.wait_reload(events[0], events[0].reload_seq)
    t.release_copied()
    _, events = t.to_device(again, [64], [None], torch.device("cpu"))
    t.reload_seq += 1
    t.wait_reload(events[0], t.reload_seq)
    t.release_host(again[0], events[0])
    third, _ = t.to_host([first.untyped_storage()], [first], [None])
    calls = cpu_transport_glue.stub_calls(rt)
    assert third[0].data_ptr() == bufs[0].data_ptr()
    assert ("wait", t._d2h_handle, events[0].handle) not in calls[seen:] and hazards(calls, host) == []


def test_reload_events_carry_the_numbers_the_handler_gives_their_parts(logging_runtime):
    """to_device numbers each part's done event as the handler numbers the part right after (reload_seq + 1, + 2, ...;
    tests/test_native_copy_out.py checks the handler's side), which to_host's reuse check compares."""
    t = cpu_transport_glue.stub_transport(logging_runtime, -1, native=True, timed_from_start=True)
    data = [torch.full((n,), n, dtype=torch.uint8) for n in (16, 32, 8)]
    bufs, _ = t.to_host([d.untyped_storage() for d in data], data, [None] * 3)
    t.release_copied()
    t.reload_seq = 5
    _, events = t.to_device(bufs, [16, 32, 8], [None] * 3, torch.device("cpu"), parts=[1, 2])
    assert [e.reload_seq for e in events] == [6, 7]
    _, events = t.to_device(bufs, [16, 32, 8], [None] * 3, torch.device("cpu"))
    assert [e.reload_seq for e in events] == [6]  # the handler had not numbered the burst above: 6 again


def test_cuda_call_count_benchmark_counts_per_layer_and_microbatch():
    """benchmarks/cpu_cuda_calls.py: one copy-out and one reload burst per layer's group at least, fences on both
    side streams, and on the copy-out stream no wait but the fence (the reuse waits are implied)."""
    if cpu_transport_glue.compiler() is None:
        pytest.skip("no C compiler for the stub CUDA runtime")
    import cpu_cuda_calls

    got = cpu_cuda_calls.count_calls("attention", layers=4, microbatches=2, experts=4)
    for per in got.values():
        assert per["copy on d2h"] > 0 and per["copy on h2d"] > 0 and per["wait on h2d (fence)"] > 0
        assert [k for k in per if k.startswith("wait on d2h")] == ["wait on d2h (fence)"]
        assert per["total"] == pytest.approx(sum(v for k, v in per.items() if k != "total"), abs=0.01)
    assert got["timed"]["total"] > got["untimed"]["total"]  # the telemetry's marks, in timed steps only
