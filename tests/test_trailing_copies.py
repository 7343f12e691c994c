"""Copies still running when a chunk's forward ends: the transport lets copied blocks go in burst order, counts what
trails at each forward end, and the summary turns the step's largest trail into one warning with the likely cause.

No CUDA needed: the transport's bursts and the summary's transports are stubs.
"""

from __future__ import annotations

from types import SimpleNamespace


class _Burst:
    """A D2H burst's done event (query answers ``done``) for :meth:`CudaTransport.release_copied`."""

    def __init__(self, done):
        self.done = done
        self.queries = 0
        self.seen_done = False

    def query(self):
        self.queries += 1
        return self.done


class _Held:
    def __init__(self, nbytes=0):
        self.streams = []
        self.nbytes = nbytes

    def record_stream(self, stream):
        self.streams.append(stream)

    def untyped_storage(self):
        return SimpleNamespace(nbytes=lambda: self.nbytes)


def test_copied_blocks_are_let_go_in_burst_order_and_the_rest_handed_to_the_allocator_at_the_end():
    from collections import deque

    from mcore_offload.runtime.transport import CudaTransport

    bursts = [_Burst(True), _Burst(False), _Burst(True)]
    tensors = [[_Held(1)], [_Held(10), _Held(100)], [_Held(1000)]]
    t = SimpleNamespace(_held=deque(zip(bursts, tensors)), d2h_stream="d2h", d2h_in_flight=0,
                        wait_at_forward_end=False)
    assert CudaTransport.release_copied(t) == 0
    # the first burst finished: gone; the second has not, and the third waits behind it (one query per burst)
    assert [b for b, _ in t._held] == bursts[1:]
    assert [b.queries for b in bursts] == [1, 1, 0]
    # the burst seen complete is marked: its reloads need not wait on it
    assert [b.seen_done for b in bursts] == [True, False, False]
    assert all(not h.streams for ts in tensors for h in ts)
    handed = CudaTransport.release_copied(t, final=True)
    assert not t._held
    # what was still held goes to the allocator guarded by the copy stream; what was let go earlier is untouched
    assert [h.streams for ts in tensors for h in ts] == [[], ["d2h"], ["d2h"], ["d2h"]]
    # and its bytes are what it handed over still being copied (end_forward counts them at a forward's end)
    assert handed == 1110


def test_a_forward_end_counts_what_is_still_being_copied_and_keeps_the_steps_largest():
    from collections import deque

    from mcore_offload.runtime.transport import CudaTransport

    t = object.__new__(CudaTransport)  # only what end_forward and release_copied touch
    t._held, t.d2h_stream, t.d2h_in_flight = deque(), "d2h", 0
    t._held.append((_Burst(False), [_Held(10), _Held(100)]))
    t.end_forward()
    t._held.append((_Burst(True), [_Held(7)]))  # finished before the next forward's end: not trailing
    t._held.append((_Burst(False), [_Held(5)]))
    t.end_forward()
    t.end_forward()  # nothing held
    assert (t.forward_ends, t.trailing_bytes) == (3, 110) and not t._held


def _stub_transport(monkeypatch, trailing_bytes: int = 0, forward_ends: int = 0) -> SimpleNamespace:
    """The one live transport the summary reads at a step's close: its trailing bytes and forward ends only."""
    import mcore_offload.runtime.transport as transport_module

    transport = SimpleNamespace(trailing_bytes=trailing_bytes, forward_ends=forward_ends,
                                pool=SimpleNamespace(allocations=0),
                                telemetry=SimpleNamespace(end_step=lambda step: None, resolve=lambda wait=False: []))
    monkeypatch.setattr(transport_module, "live_transports", lambda: [transport])
    return transport


def test_copies_trailing_a_forward_are_a_step_figure_and_warn_once(caplog, monkeypatch):
    from mcore_offload.summary import TRAILING_MIN_BYTES, OffloadSummary

    mib = 2**20
    summary = OffloadSummary()
    transport = _stub_transport(monkeypatch)
    # (trailing, released in the step's 4 forwards): 1335 MiB a forward, as A's attention set; a quarter is 334 MiB
    steps = [(48 * mib, 4 * 1335 * mib), (200 * mib, 4 * 1335 * mib), (674 * mib, 4 * 1335 * mib),
             (700 * mib, 4 * 1335 * mib)]
    with caplog.at_level("WARNING", logger="mcore_offload.summary"):
        for trailing, released in steps:
            summary.add("core_attn", "released_in_forward", released)
            transport.trailing_bytes, transport.forward_ends = trailing, 4
            summary.close_step()
            assert transport.trailing_bytes == transport.forward_ends == 0  # taken by the step
    assert [s.trailing_bytes // mib for s in summary.steps] == [48, 200, 674, 700]
    assert summary.link_series()["trailing_bytes"] == [s.trailing_bytes for s in summary.steps]
    assert all(s.forward_ends == 4 for s in summary.steps)
    # 48 MiB is under 64; 200 MiB is under a quarter of a forward's 1335 (one late layer is normal); 674 warns, once
    assert 48 * mib < TRAILING_MIN_BYTES
    warnings = [r.getMessage() for r in caplog.records if "still being copied" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("offload step 2: 674 MiB were still being copied")
    assert "1335 MiB a forward offloads" in warnings[0] and "MCORE_OFFLOAD_D2H_IN_FLIGHT=1" in warnings[0]
    assert "MCORE_OFFLOAD_FORWARD_END=wait" in warnings[0]


def test_copies_all_trailing_a_forward_name_the_bound_not_the_forward_end_wait(caplog, monkeypatch):
    """Every byte a forward released still being copied at its end (session 85's B: 1312 of 1312 MiB) means the host
    ran ahead and saw no copy finish: the warning points to the bound inside the forward, and says the forward-end
    wait does not help there; a share under 90 % keeps the link advice."""
    from mcore_offload.summary import OffloadSummary

    mib = 2**20

    def warning_for(trailing_mib: int) -> str:
        summary = OffloadSummary()
        _stub_transport(monkeypatch, trailing_mib * mib, forward_ends=4)
        caplog.clear()
        with caplog.at_level("WARNING", logger="mcore_offload.summary"):
            summary.add("core_attn", "released_in_forward", 4 * 1312 * mib)
            summary.close_step()
        found = [r.getMessage() for r in caplog.records if "still being copied" in r.getMessage()]
        assert len(found) == 1
        return found[0]

    ahead = warning_for(1312)
    assert "1312 MiB were still being copied" in ahead and "the host ran ahead of the GPU" in ahead
    assert "MCORE_OFFLOAD_D2H_IN_FLIGHT=2" in ahead and "does not help a peak inside it" in ahead
    behind = warning_for(1100)  # 84 %: some copies finished during the forward
    assert "the link behind the forward" in behind and "host ran ahead" not in behind
    assert "MCORE_OFFLOAD_FORWARD_END=wait" in behind
