"""The runtime's own switch where the host runs ahead of a GPU-bound forward (runtime/host_ahead.py), on stub
transports: when it switches, what it switches, when it undoes it, and when it stays out of the way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mcore_offload.runtime.host_ahead import (
    ADAPTED_FLUSH_LAYERS,
    ADAPTED_IN_FLIGHT,
    AHEAD_STEPS,
    HostAheadAdapter,
    host_ahead_mode,
)
from mcore_offload.runtime.manager import get_manager
from mcore_offload.runtime.telemetry import StepLink
from mcore_offload.summary import OffloadSummary

MIB = 2**20
FORWARD_MIB = 1312  # session 85's B attention set: what one chunk forward offloads and releases


def _transport() -> SimpleNamespace:
    """What the summary's close and the adapter read and write on a transport."""
    return SimpleNamespace(trailing_bytes=0, forward_ends=0, d2h_in_flight=0, in_flight_waits=0,
                           wait_at_forward_end=False, pool=SimpleNamespace(allocations=0, allocated_bytes=0),
                           telemetry=SimpleNamespace(end_step=lambda step: None, resolve=lambda wait=False: [],
                                                     timing=False, timed=True))


@pytest.fixture
def rig(monkeypatch):
    """A summary wired to an adapter, one stub transport and a manager stand-in; ``step(trailing_mib)`` closes a
    step of four forwards with that much still copying at the worst forward end."""
    import mcore_offload.runtime.transport as transport_module

    for name in ("MCORE_OFFLOAD_FLUSH_LAYERS", "MCORE_OFFLOAD_D2H_IN_FLIGHT", "MCORE_OFFLOAD_FORWARD_END",
                 "MCORE_OFFLOAD_HOST_AHEAD"):
        monkeypatch.delenv(name, raising=False)
    transport = _transport()
    monkeypatch.setattr(transport_module, "live_transports", lambda: [transport])
    summary = OffloadSummary()
    adapter = summary.host_ahead = HostAheadAdapter()
    manager = SimpleNamespace(flush_layers=2)

    def step(trailing_mib: int, planning: bool = False, aborted: bool = False) -> None:
        summary.add("core_attn", "released_in_forward", 4 * FORWARD_MIB * MIB)
        transport.trailing_bytes, transport.forward_ends = trailing_mib * MIB, 4
        summary.close_step(aborted=aborted)
        adapter.step_closed(summary, manager, [transport], planning=planning)

    return SimpleNamespace(step=step, summary=summary, adapter=adapter, manager=manager, transport=transport)


def _set_stalls(summary: OffloadSummary, stalls: dict[int, float], step_ms: float = 430.0) -> None:
    """Attach GPU-timed link figures to the given steps, as the telemetry does a step or so late."""
    for i, stall in stalls.items():
        summary.steps[i].link = StepLink(stall_ms=stall)
        summary.steps[i].host_step_ms = step_ms


def test_four_host_ahead_steps_in_a_row_switch_to_per_layer_bursts_two_in_flight(rig, caplog):
    assert AHEAD_STEPS == 4
    with caplog.at_level("INFO", logger="mcore_offload"):
        for _ in range(3):  # three steps are not yet the pattern (A's attention set on a fast host had two)
            rig.step(FORWARD_MIB)
        assert rig.adapter.state == "watching" and rig.manager.flush_layers == 2
        rig.step(600)  # 46 % trailing: the link behind, not the host ahead; the run starts again
        for _ in range(3):
            rig.step(FORWARD_MIB)
        assert rig.adapter.state == "watching" and not rig.transport.telemetry.timing
        rig.step(FORWARD_MIB)
    assert rig.adapter.state == "adapted" and rig.adapter.adapted_at == 8
    settings = (rig.manager.flush_layers, rig.transport.d2h_in_flight)
    assert settings == (ADAPTED_FLUSH_LAYERS, ADAPTED_IN_FLIGHT) == (1, 2)
    assert rig.transport.telemetry.timing  # every step is timed until the switch is judged
    lines = [r.getMessage() for r in caplog.records if "ran ahead" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("offload step 7: the host ran ahead of the GPU in 4 steps in a row")
    assert "1312 of the 1312 MiB" in lines[0] and "from step 8" in lines[0]
    assert "MCORE_OFFLOAD_HOST_AHEAD=warn keeps the settings" in lines[0]
    # the summary's host-ahead warning is the adapter's to give; step 3's link-behind share warned as before
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "600 MiB were still being copied" in warned[0] and "link behind" in warned[0]
    assert rig.summary.as_dict()["host_ahead"]["state"] == "adapted"
    assert "per-layer copy-out bursts from step 8, adapted" in rig.summary.table()


def _switch(rig) -> int:
    """Run the host-ahead steps that make the switch; the first switched step's number."""
    for _ in range(AHEAD_STEPS):
        rig.step(FORWARD_MIB)
    assert rig.adapter.state == "adapted"
    return rig.adapter.adapted_at


def test_the_switch_is_kept_when_the_stall_does_not_grow(rig, caplog):
    k = _switch(rig)
    rig.step(0)  # step k: switched, nothing trailing any more (the bound waits at the forward's end)
    _set_stalls(rig.summary, {k - 2: 0.0, k - 1: 0.0, k: 0.4})
    with caplog.at_level("INFO", logger="mcore_offload"):
        rig.step(0)  # only one switched step timed: not judged yet
        assert rig.adapter.state == "adapted"
        _set_stalls(rig.summary, {k + 1: 0.2})
        rig.step(0)
    assert rig.adapter.state == "kept" and rig.adapter.judged_at == k + 1
    judged = rig.adapter.as_dict()
    assert judged["stall_ms_before"] == 0.0 and judged["stall_ms_after"] == pytest.approx(0.3)
    assert (rig.manager.flush_layers, rig.transport.d2h_in_flight) == (1, 2)
    assert any(f"kept after steps {k}-{k + 1}" in r.getMessage() for r in caplog.records)
    rig.transport.telemetry.timing = False  # as the telemetry's own sampling sets it at a step's end
    rig.step(0)
    assert not rig.transport.telemetry.timing  # judged: back to one step in MCORE_OFFLOAD_TELEMETRY_EVERY


def test_the_switch_is_undone_where_the_compute_stream_waits_longer(rig, caplog):
    """Session 85's B with two-layer bursts under the bound: 12 ms a step of stall, far over 1 % of 430 ms."""
    k = _switch(rig)
    for _ in range(2):
        rig.step(0)
    _set_stalls(rig.summary, {k - 2: 0.5, k - 1: 0.5, k: 12.0, k + 1: 12.2})
    with caplog.at_level("INFO", logger="mcore_offload"):
        rig.step(0)
        assert rig.adapter.state == "reverted"
        assert (rig.manager.flush_layers, rig.transport.d2h_in_flight) == (2, 0)  # the earlier settings
        for _ in range(AHEAD_STEPS + 1):  # the host runs ahead again: no second switch, and no advice to try it
            rig.step(FORWARD_MIB)
    assert rig.adapter.state == "reverted" and rig.manager.flush_layers == 2
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and warned[0].startswith(f"offload steps {k}-{k + 1}: with one copy-out burst per layer")
    assert "12.1 ms a step on the copies against 0.5 ms before" in warned[0] and f"from step {k + 3}" in warned[0]


def test_a_growth_within_the_margin_keeps_the_switch(rig):
    """The margin is the larger of 1 ms and 1 % of the step: 4.3 ms at 430 ms."""
    k = _switch(rig)
    rig.step(0)
    rig.step(0)
    _set_stalls(rig.summary, {k - 1: 1.0, k: 5.0, k + 1: 5.2})
    rig.step(0)
    assert rig.adapter.state == "kept"


def test_no_switch_while_auto_probes_or_after_an_aborted_step(rig):
    for _ in range(AHEAD_STEPS):
        rig.step(FORWARD_MIB, planning=True)
    assert rig.adapter.state == "watching"
    for _ in range(AHEAD_STEPS - 1):
        rig.step(FORWARD_MIB)
    rig.step(FORWARD_MIB, aborted=True)
    assert rig.adapter.state == "watching" and rig.manager.flush_layers == 2
    _switch(rig)


@pytest.mark.parametrize("variable", ["MCORE_OFFLOAD_FLUSH_LAYERS", "MCORE_OFFLOAD_D2H_IN_FLIGHT",
                                      "MCORE_OFFLOAD_FORWARD_END"])
def test_a_user_who_chose_the_copy_out_settings_keeps_them_and_gets_the_warning(variable, monkeypatch, caplog):
    import mcore_offload.runtime.transport as transport_module

    monkeypatch.setenv(variable, "1" if "FORWARD_END" not in variable else "hand-over")
    transport = _transport()
    monkeypatch.setattr(transport_module, "live_transports", lambda: [transport])
    summary = OffloadSummary()
    adapter = summary.host_ahead = HostAheadAdapter()
    manager = SimpleNamespace(flush_layers=2)
    assert adapter.state == "off" and adapter.as_dict()["chosen_by_user"] == [variable]
    with caplog.at_level("WARNING", logger="mcore_offload"):
        for _ in range(AHEAD_STEPS + 1):
            summary.add("core_attn", "released_in_forward", 4 * FORWARD_MIB * MIB)
            transport.trailing_bytes, transport.forward_ends = FORWARD_MIB * MIB, 4
            summary.close_step()
            adapter.step_closed(summary, manager, [transport], planning=False)
    assert manager.flush_layers == 2 and transport.d2h_in_flight == 0
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "the host ran ahead of the GPU" in warned[0]
    assert "MCORE_OFFLOAD_FLUSH_LAYERS=1" in warned[0] and "MCORE_OFFLOAD_D2H_IN_FLIGHT=2" in warned[0]


def test_warn_mode_and_a_bad_value(monkeypatch):
    assert HostAheadAdapter(mode="warn").state == "off"
    assert HostAheadAdapter(mode="adapt", environ={}).state == "watching"
    monkeypatch.setenv("MCORE_OFFLOAD_HOST_AHEAD", "sometimes")
    with pytest.raises(ValueError, match="MCORE_OFFLOAD_HOST_AHEAD"):
        host_ahead_mode()


def test_the_manager_switches_its_bursts_through_end_step(monkeypatch):
    """Wired in: the manager's end_step hands each training step's record to its adapter, and after the switch a
    chunk flushes at every layer (``_flush_due``), as under MCORE_OFFLOAD_FLUSH_LAYERS=1."""
    import mcore_offload.runtime.manager as manager_module
    import mcore_offload.runtime.transport as transport_module

    for name in ("MCORE_OFFLOAD_FLUSH_LAYERS", "MCORE_OFFLOAD_D2H_IN_FLIGHT", "MCORE_OFFLOAD_FORWARD_END"):
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
    for _ in range(AHEAD_STEPS):
        manager.summary.add("core_attn", "released_in_forward", 4 * FORWARD_MIB * MIB)
        transport.trailing_bytes, transport.forward_ends = FORWARD_MIB * MIB, 4
        manager._trained = True
        manager.end_step()
    assert manager.host_ahead.state == "adapted"
    assert (manager.flush_layers, transport.d2h_in_flight) == (1, 2)
    assert manager._flush_due(handler)
