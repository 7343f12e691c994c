"""The runtime's choice of copy-out settings by how far the host runs ahead of the GPU (runtime/host_ahead.py), on
stub transports: the probe of the first steps, the later switch, the judge, and when it stays out of the way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mcore_offload.runtime.host_ahead import (
    ADAPTED_FLUSH_LAYERS,
    ADAPTED_IN_FLIGHT,
    AHEAD_STEPS,
    PROBE_LINK_STEPS,
    PROBE_SHARE,
    PROBE_STEPS,
    HostAheadAdapter,
    host_ahead_mode,
)
from mcore_offload.runtime.manager import get_manager
from mcore_offload.runtime.telemetry import LinkTelemetry, StepLink
from mcore_offload.summary import OffloadSummary, StepRecord
from tests.test_telemetry import FakeEvent

MIB = 2**20
FORWARD_MIB = 1312  # session 85's B attention set: what one chunk forward offloads and releases
COPY_OUT_VARIABLES = ("MCORE_OFFLOAD_FLUSH_LAYERS", "MCORE_OFFLOAD_D2H_IN_FLIGHT", "MCORE_OFFLOAD_FORWARD_END",
                      "MCORE_OFFLOAD_HOST_AHEAD")


def _transport() -> SimpleNamespace:
    """What the summary's close and the adapter read and write on a transport."""
    return SimpleNamespace(trailing_bytes=0, forward_ends=0, d2h_in_flight=0, in_flight_waits=0, bound_bytes=0,
                           wait_at_forward_end=False, pool=SimpleNamespace(allocations=0, allocated_bytes=0),
                           telemetry=SimpleNamespace(end_step=lambda step: None, resolve=lambda wait=False: [],
                                                     timing=False, timed=True))


@pytest.fixture
def rig(monkeypatch):
    """A summary wired to an adapter, one stub transport and a manager stand-in. ``step(trailing_mib, waited_mib)``
    runs a step of four forwards: its chunks start, 4 x 1312 MiB go out, ``waited_mib`` of it the compute stream
    waited for, ``trailing_mib`` still copying at the worst forward end."""
    import mcore_offload.runtime.transport as transport_module

    for name in COPY_OUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    transport = _transport()
    monkeypatch.setattr(transport_module, "live_transports", lambda: [transport])
    summary = OffloadSummary()
    adapter = summary.host_ahead = HostAheadAdapter()
    manager = SimpleNamespace(flush_layers=2, auto=None)

    def step(trailing_mib: int = 0, waited_mib: int = 0, planning: bool = False, aborted: bool = False) -> None:
        for _ in range(4):
            adapter.chunk_started(manager, transport)
        summary.add("core_attn", "offloaded", 4 * FORWARD_MIB * MIB)
        summary.add("core_attn", "released_in_forward", 4 * FORWARD_MIB * MIB)
        transport.trailing_bytes, transport.forward_ends = trailing_mib * MIB, 4
        transport.bound_bytes += waited_mib * MIB
        summary.close_step(aborted=aborted)
        adapter.step_closed(summary, manager, [transport], planning=planning)

    return SimpleNamespace(step=step, summary=summary, adapter=adapter, manager=manager, transport=transport)


def _settings(rig) -> tuple[int, int]:
    return rig.manager.flush_layers, rig.transport.d2h_in_flight


def _set_bound(rig, bound: dict[int, float], span_ms: float = 430.0) -> None:
    """Attach GPU-timed link figures to the given steps, as the telemetry does a step or so late, and give each a
    forward and backward of ``span_ms`` on the host (the adapter's own clock reads microseconds here)."""
    for i, ms in bound.items():
        rig.summary.steps[i].link = StepLink(stall_ms=ms, bound_ms=ms)
        rig.adapter.step_spans_ms[i] = span_ms


@pytest.mark.parametrize("waited_mib", [4 * FORWARD_MIB - 100, 4128], ids=["share-0.98", "share-0.79"])
def test_the_first_steps_run_per_layer_bursts_and_keep_them_where_the_host_runs_ahead(rig, caplog, waited_mib):
    """B's attention set read 0.97 on session 86's host and 0.79 (4128 of 5248 MiB) on session 87's slower one, and
    waited 0.00 ms on the copies on the GPU both times."""
    assert PROBE_STEPS == 2 and rig.adapter.state == "probing"
    with caplog.at_level("INFO", logger="mcore_offload"):
        rig.step(waited_mib=2000)  # the warm-up step: not read
        assert rig.adapter.state == "probing" and _settings(rig) == (ADAPTED_FLUSH_LAYERS, ADAPTED_IN_FLIGHT) == (1, 2)
        rig.step(waited_mib=waited_mib)  # most of it waited for: the host saw few bursts finish
        assert rig.adapter.probe_share == pytest.approx(waited_mib / (4 * FORWARD_MIB))
        assert PROBE_SHARE == 0.5 and rig.adapter.probe_share >= PROBE_SHARE
        # the share passed; the probe step's waits are timed on the GPU and come a step late: settings stay on
        assert rig.adapter.state == "probing" and rig.transport.telemetry.timing
        assert not [r for r in caplog.records if "copied out" in r.getMessage()]
        _set_bound(rig, {1: 0.0})
        rig.step(waited_mib=waited_mib)
    assert rig.adapter.state == "adapted" and rig.adapter.adapted_at == 0 and _settings(rig) == (1, 2)
    [line] = [r.getMessage() for r in caplog.records if "copied out" in r.getMessage()]
    assert line.startswith(f"offload step 1: the compute stream had to wait for {waited_mib} of the 5248 MiB copied")
    assert "0.00 ms on the GPU" in line and "keeping one copy-out burst per layer" in line
    assert "MCORE_OFFLOAD_HOST_AHEAD=warn runs the defaults" in line
    assert rig.summary.as_dict()["host_ahead"]["state"] == "adapted"
    assert "per-layer copy-out bursts from step 0, adapted" in rig.summary.table()


def test_the_probe_sends_back_a_run_whose_copy_out_waits_cost_step_time(rig, caplog):
    """Session 86's A attention set on a fast host: a share of 0.67 (3792 of 5696 MiB, here of 5248), where the link
    cannot keep up with the forward; its probe step waited 12.6 ms on the copies, over 1 % of a 330 ms step. The
    defaults come back for good (lease 4 kept them at +8.1 %), with an INFO line, and no later switch."""
    with caplog.at_level("INFO", logger="mcore_offload"):
        rig.step(waited_mib=4 * FORWARD_MIB)
        rig.step(waited_mib=3500)
        assert rig.adapter.state == "probing" and _settings(rig) == (1, 2)
        _set_bound(rig, {1: 12.6}, 330.0)
        rig.step(waited_mib=3500)
        assert rig.adapter.state == "reverted" and _settings(rig) == (2, 0)
        for _ in range(AHEAD_STEPS + 1):  # the host runs ahead again later: no switch
            rig.step(trailing_mib=FORWARD_MIB)
    assert rig.adapter.state == "reverted" and _settings(rig) == (2, 0)
    # copies that trail the forward must not count at the peak after it: the forward-end wait comes with the defaults,
    # also on a transport made after the revert (a later chunk's)
    assert rig.transport.wait_at_forward_end
    later = _transport()
    rig.adapter.chunk_started(rig.manager, later)
    assert later.wait_at_forward_end and later.d2h_in_flight == 0
    assert rig.adapter.bound_ms == 12.6 and rig.adapter.judged_at == 1 and not rig.adapter.step_spans_ms
    [line] = [r.getMessage() for r in caplog.records if "does not keep up" in r.getMessage()]
    assert line.startswith("offload step 1: with one copy-out burst per layer and 2 in flight the compute stream "
                           "waited 12.6 ms on the copies (more than 3.3 ms of a 330 ms forward and backward)")
    assert "the default copy-out bursts from step 3, the compute stream waiting at each forward's end" in line
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    table = rig.summary.table()
    assert "per-layer copy-out bursts probed, reverted after the compute stream waited 12.6 ms on them in step 1: " \
        "the defaults with the forward-end wait" in table
    assert "copy-out waited for at forward ends (after a revert)" in table


def test_without_the_probe_steps_figures_the_share_decides(rig):
    """A transport without a clock (or figures that never complete) does not hold the probe: after
    ``PROBE_LINK_STEPS`` more steps the share alone keeps the settings."""
    rig.step(waited_mib=5000)
    rig.step(waited_mib=5000)
    for _ in range(PROBE_LINK_STEPS - 1):
        rig.step(waited_mib=5000)
        assert rig.adapter.state == "probing"
    rig.step(waited_mib=5000)
    assert rig.adapter.state == "adapted" and _settings(rig) == (1, 2)


@pytest.mark.parametrize("waited_mib", [4 * 192, 0])
def test_the_defaults_come_back_where_the_host_keeps_up(rig, caplog, waited_mib):
    """15 %: only the last burst of each forward waited for. 0 %: session 87's A attention set and C's experts on a
    slow host, every burst finished before the host came back to it."""
    with caplog.at_level("INFO", logger="mcore_offload"):
        rig.step(waited_mib=4 * FORWARD_MIB)  # a slow warm-up step reads as host-ahead: not read
        rig.step(waited_mib=waited_mib)
    assert rig.adapter.state == "watching" and _settings(rig) == (2, 0)
    rig.step()
    assert _settings(rig) == (2, 0)  # a chunk start no longer puts the adapted settings on
    assert not rig.transport.wait_at_forward_end  # the host keeps up: nothing trails, no wait
    [line] = [r.getMessage() for r in caplog.records if "copied out" in r.getMessage()]
    assert f"{waited_mib} of the 5248 MiB" in line and "the default copy-out bursts from step 2" in line


def test_kept_settings_are_judged_on_the_copy_out_waits_and_undone_where_they_cost(rig, caplog):
    """Session 86's A attention set on a fast host waited 12.6, 0.0 and 2.6 ms on the copies in steps 1-3; in another
    order, with the probe's step 1 at 0.0, the probe keeps the settings and the judge reads the mean, 5.1 ms, over
    1 % of a 330 ms forward and backward (3.3 ms); the reloads' own stall does not count."""
    rig.step(waited_mib=5000)
    rig.step(waited_mib=5000)
    _set_bound(rig, {0: 30.0, 1: 0.0}, 330.0)  # step 0, the warm-up, is not judged
    rig.step(waited_mib=5000)
    assert rig.adapter.state == "adapted"
    with caplog.at_level("INFO", logger="mcore_offload"):
        _set_bound(rig, {2: 12.6}, 330.0)
        rig.step(waited_mib=5000)
        assert rig.adapter.state == "adapted" and rig.transport.telemetry.timing  # timed until judged
        _set_bound(rig, {3: 2.6}, 330.0)
        rig.step(waited_mib=5000)
        assert rig.adapter.state == "reverted" and _settings(rig) == (2, 0)
        rig.step()  # a chunk start puts nothing back
        for _ in range(AHEAD_STEPS + 1):  # the host runs ahead again: no second switch, and no advice to try it
            rig.step(trailing_mib=FORWARD_MIB)
    assert rig.adapter.state == "reverted" and _settings(rig) == (2, 0) and rig.transport.wait_at_forward_end
    assert rig.adapter.bound_ms == pytest.approx(5.0667, abs=1e-3) and rig.adapter.judged_at == 3
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith("offload steps 1-3: with one copy-out burst per layer and 2")
    assert "waited 5.1 ms a step on the copies, on average (more than 3.3 ms of a 330 ms forward and backward)" \
        in warned[0]
    assert "back from step 5, the compute stream waiting at each forward's end" in warned[0]
    # under pipelining the waits need not be step time (session 89): the advice says how to check
    assert warned[0].endswith("compare with MCORE_OFFLOAD_HOST_AHEAD=warn)")


def test_kept_settings_that_cost_under_the_margin_stay(rig, caplog):
    """B: nothing waited on the copies in any judged step; a single wait of a few ms in three steps stays under
    the margin too."""
    for _ in range(4):
        rig.step(waited_mib=5000)
    _set_bound(rig, {1: 0.0, 2: 3.0, 3: 0.0})
    with caplog.at_level("INFO", logger="mcore_offload"):
        rig.step(waited_mib=5000)
    assert rig.adapter.state == "kept" and _settings(rig) == (1, 2) and rig.adapter.bound_ms == pytest.approx(1.0)
    assert any("kept after steps 1-3" in r.getMessage() for r in caplog.records)
    assert not rig.adapter.step_spans_ms  # judged: the spans are not kept any more
    rig.step(waited_mib=5000)
    assert _settings(rig) == (1, 2) and not rig.adapter.step_spans_ms


def test_a_step_span_runs_from_its_first_chunk_start_to_its_close(rig):
    rig.step(waited_mib=5000)
    assert list(rig.adapter.step_spans_ms) == [0] and 0.0 < rig.adapter.step_spans_ms[0] < 60_000


def test_a_run_on_the_defaults_switches_after_four_host_ahead_steps_in_a_row(rig, caplog):
    rig.step()
    rig.step()  # the probe: nothing waited for, back to the defaults
    assert rig.adapter.state == "watching"
    with caplog.at_level("INFO", logger="mcore_offload"):
        for _ in range(AHEAD_STEPS - 1):  # three are not yet the pattern (A's attention set on a fast host had two)
            rig.step(trailing_mib=FORWARD_MIB)
        rig.step(trailing_mib=600)  # 46 % trailing: the link behind, not the host ahead; the run starts again
        for _ in range(AHEAD_STEPS - 1):
            rig.step(trailing_mib=FORWARD_MIB)
        assert rig.adapter.state == "watching" and _settings(rig) == (2, 0)
        rig.step(trailing_mib=FORWARD_MIB)
    assert rig.adapter.state == "adapted" and rig.adapter.adapted_at == 10 and _settings(rig) == (1, 2)
    assert rig.transport.telemetry.timing
    [line] = [r.getMessage() for r in caplog.records if "ran ahead" in r.getMessage()]
    assert line.startswith("offload step 9: the host ran ahead of the GPU in 4 steps in a row")
    # "on average": under pipelining the forwards whose layers stay on the device make the mean lower than one
    # whole forward's bytes (session 89's D: 368 MiB trailing, 320 on average)
    assert "1312 MiB still being copied at a forward's end, where a forward offloads 1312 MiB on average" in line
    assert "from step 10" in line
    # the summary's host-ahead warning is the adapter's to give; step 5's link-behind share warned as before
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "600 MiB were still being copied" in warned[0] and "link behind" in warned[0]


def test_auto_and_aborted_steps(rig):
    rig.step(aborted=True)  # an aborted step is no probe step
    rig.step(waited_mib=5000)
    assert rig.adapter.state == "probing"
    rig.step(waited_mib=5000)
    _set_bound(rig, {2: 0.0})  # the probe's step is the second one that ran whole
    rig.step(waited_mib=5000)
    assert rig.adapter.state == "adapted"
    adapter, transport = HostAheadAdapter(environ={}), _transport()
    manager = SimpleNamespace(flush_layers=2, auto=object())
    adapter.chunk_started(manager, transport)  # auto's probes measure the defaults
    assert adapter.state == "watching" and (manager.flush_layers, transport.d2h_in_flight) == (2, 0)


@pytest.mark.parametrize("variable", COPY_OUT_VARIABLES[:3])
def test_a_user_who_chose_the_copy_out_settings_keeps_them_and_gets_the_warning(variable, monkeypatch, caplog):
    import mcore_offload.runtime.transport as transport_module

    monkeypatch.setenv(variable, "1" if "FORWARD_END" not in variable else "hand-over")
    transport = _transport()
    monkeypatch.setattr(transport_module, "live_transports", lambda: [transport])
    summary = OffloadSummary()
    adapter = summary.host_ahead = HostAheadAdapter()
    manager = SimpleNamespace(flush_layers=2, auto=None)
    assert adapter.state == "off" and adapter.as_dict()["chosen_by_user"] == [variable]
    with caplog.at_level("WARNING", logger="mcore_offload"):
        for _ in range(AHEAD_STEPS + 1):
            adapter.chunk_started(manager, transport)
            summary.add("core_attn", "released_in_forward", 4 * FORWARD_MIB * MIB)
            transport.trailing_bytes, transport.forward_ends = FORWARD_MIB * MIB, 4
            summary.close_step()
            adapter.step_closed(summary, manager, [transport], planning=False)
    assert manager.flush_layers == 2 and transport.d2h_in_flight == 0
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "the host ran ahead of the GPU" in warned[0]
    assert "MCORE_OFFLOAD_FLUSH_LAYERS=1" in warned[0] and "MCORE_OFFLOAD_D2H_IN_FLIGHT=2" in warned[0]


def test_warn_mode_coalesced_buffers_and_a_bad_value(monkeypatch):
    assert HostAheadAdapter(mode="warn").state == "off"
    coalesced = HostAheadAdapter(mode="adapt", environ={"MCORE_OFFLOAD_COALESCE_RELOADS": "1"})
    assert coalesced.state == "off" and coalesced.chosen == ["MCORE_OFFLOAD_COALESCE_RELOADS"]
    assert HostAheadAdapter(mode="adapt", environ={"MCORE_OFFLOAD_COALESCE_RELOADS": "0"}).state == "probing"
    assert HostAheadAdapter(mode="adapt", environ={}).state == "probing"
    monkeypatch.setenv("MCORE_OFFLOAD_HOST_AHEAD", "sometimes")
    with pytest.raises(ValueError, match="MCORE_OFFLOAD_HOST_AHEAD"):
        host_ahead_mode()


def test_a_wait_for_copy_out_bursts_counts_their_bytes_and_its_own_telemetry_kind():
    """``_wait_for_held`` (the bound, the forward-end wait) adds the bursts' bytes to ``bound_bytes`` and times the
    wait as "bound": the step's ``bound_ms``, part of its ``stall_ms``."""
    from collections import deque

    from mcore_offload.runtime.transport import CudaTransport
    from tests.test_trailing_copies import _Burst, _Held

    tel = LinkTelemetry(FakeEvent)
    t = object.__new__(CudaTransport)
    waited = []
    t.telemetry = tel
    t.wait = lambda event, kind="stall": waited.append(kind)
    t._held = deque([(_Burst(False), [_Held(10), _Held(100)]), (_Burst(False), [_Held(7)]), (_Burst(False), [])])
    t._wait_for_held(2)
    assert waited == ["bound"] and t.bound_bytes == 117 and len(t._held) == 1 and t.in_flight_waits == 1
    FakeEvent.clock = 0.0
    arrival, reload_arrival = tel.mark("compute"), tel.mark("compute")
    FakeEvent.clock = 3.0
    done = tel.mark("d2h")
    FakeEvent.clock = 3.5
    reload_done = tel.mark("h2d")
    tel.span("bound", arrival, done, keep_end=True)
    tel.span("stall", reload_arrival, reload_done, keep_end=True)
    tel.end_step(0)
    for e in (arrival, reload_arrival, done, reload_done):
        e.done = True
    [(_, link)] = tel.resolve()
    assert link.bound_ms == pytest.approx(3.0) and link.stall_ms == pytest.approx(6.5) and link.waits == 2
    summary = OffloadSummary()
    summary.steps.append(StepRecord(0, False, {}, link=link))
    assert summary.link_series()["bound_ms"] == [pytest.approx(3.0)]  # per step in the JSON (as_dict's per_step)


def test_the_manager_puts_the_settings_on_at_a_chunk_start_and_decides_at_end_step(monkeypatch):
    """Wired in: the manager's chunk start hands the handler's transport to its adapter, and its end_step each
    training step's record; under the adapted settings a chunk flushes at every layer (``_flush_due``)."""
    import mcore_offload.runtime.manager as manager_module
    import mcore_offload.runtime.transport as transport_module

    for name in COPY_OUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    manager_module.reset()
    transport = _transport()
    monkeypatch.setattr(transport_module, "live_transports", lambda: [transport])
    monkeypatch.setattr(manager_module, "live_transports", lambda: [transport])
    manager = get_manager()
    assert manager.summary.host_ahead is manager.host_ahead and manager.flush_layers == 2
    handler = SimpleNamespace(vp_stage=None, marks=None, layers=2)
    manager._chunk_layers[None] = 8
    assert not manager._flush_due(handler)  # two-layer bursts aligned to the chunk's end: this layer waits
    for _ in range(PROBE_STEPS + PROBE_LINK_STEPS):  # the stub telemetry has no figures: the share decides
        manager.host_ahead.chunk_started(manager, transport)
        assert manager._flush_due(handler)
        manager.summary.add("core_attn", "offloaded", 4 * FORWARD_MIB * MIB)
        transport.bound_bytes += 4 * FORWARD_MIB * MIB
        manager._trained = True
        manager.end_step()
    assert manager.host_ahead.state == "adapted" and (manager.flush_layers, transport.d2h_in_flight) == (1, 2)
