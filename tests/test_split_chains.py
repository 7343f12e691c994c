"""A chain's first point comes back last, in a reload part of its own, and backward waits for it only where that
point's backward starts (``MCORE_OFFLOAD_SPLIT_CHAINS``, runtime/prefetch.py ``_chain_parts``). Same values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_flush_bursts import steps_forward_all_then_backward
from test_runtime_unit import Toy, cfg

from mcore_offload.runtime import manager as manager_module
from mcore_offload.runtime.handler import ChunkOffloadHandler

CHAIN = ["qkv_linear", "core_attn", "attn_proj"]


def _train(monkeypatch, names, split):
    """Losses and gradients of two steps; the points of every run of each Python reload call; at each group's
    backward start and end, whether each of its entries was waited for, by point. The hooks are the ones the
    test's ``hook_impl`` chose."""
    monkeypatch.setenv("MCORE_OFFLOAD_SPLIT_CHAINS", split)
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "0")  # hooks that call the handler's methods recorded below
    manager_module.reset()
    reloads: list[list[list[str]]] = []
    at_start: list[list[tuple[str, bool]]] = []
    at_end: list[list[tuple[str, bool]]] = []
    real_reload = ChunkOffloadHandler._reload
    real_commit = ChunkOffloadHandler.on_group_commit_backward
    real_done = ChunkOffloadHandler.on_group_backward_done

    def reload(self, *runs, on_demand=False):
        reloads.append([[e.point for e in run if e.device_storage is None and e.host is not None] for run in runs])
        return real_reload(self, *runs, on_demand=on_demand)

    def commit(self, group=None):
        real_commit(self, group)
        if group is not None and group.entries:
            at_start.append([(e.point, e.compute_waited) for e in group.entries])

    def done(self, group):
        if group.entries and not group.done:
            at_end.append([(e.point, e.compute_waited) for e in group.entries])
        return real_done(self, group)

    with pytest.MonkeyPatch.context() as methods:  # this run only (``monkeypatch`` holds the test's settings)
        methods.setattr(ChunkOffloadHandler, "_reload", reload)
        methods.setattr(ChunkOffloadHandler, "on_group_commit_backward", commit)
        methods.setattr(ChunkOffloadHandler, "on_group_backward_done", done)
        # microbatch 0 does not turn around: its last layer and the layer below come back late (the ``tail`` moment)
        out = steps_forward_all_then_backward(Toy(cfg(*names), layers=4))
    return out, reloads, at_start, at_end


def _equal(a, b):
    return all(torch.equal(x, y) for (l0, g0), (l1, g1) in zip(a, b) for x, y in zip(l0 + g0, l1 + g1))


def _first_point_parts(reloads):
    """Reload calls where a run of the first point's storages alone follows a run without them."""
    return [runs for runs in reloads for before, after in zip(runs, runs[1:])
            if after and set(after) == {"qkv_linear"} and before and "qkv_linear" not in before]


@pytest.mark.parametrize("split", ["1", "0"])
def test_a_late_chain_reload_brings_the_first_point_last_and_waits_for_it_at_its_unpack(monkeypatch, hook_impl,
                                                                                       split):
    base, *_ = _train(monkeypatch, [], split)
    got, reloads, at_start, at_end = _train(monkeypatch, CHAIN, split)
    assert (manager_module.get_manager().native is not None) == (hook_impl == "native")
    assert _equal(base, got)
    late = _first_point_parts(reloads)
    held_back = [entries for entries in at_start if any(p == "qkv_linear" and not w for p, w in entries)]
    if split == "1":
        # two late moments per step (microbatch 0's last layer at its backward's start, and the layer below)
        assert len(late) >= 4
        assert held_back, "a late chain's first point was waited for at the group's start"
        for entries in held_back:  # everything the later points saved was waited for at the start
            assert all(w for p, w in entries if p != "qkv_linear")
    else:
        assert not late and not held_back
    # by the group's end every entry was waited for: the first point's at its unpack
    assert at_end and all(w for entries in at_end for _, w in entries)


def test_a_single_point_group_is_never_split(monkeypatch, hook_impl):
    _, reloads, at_start, _ = _train(monkeypatch, ["core_attn"], "1")
    assert all(len(runs) == 1 for runs in reloads if any(runs))
    assert all(w for entries in at_start for _, w in entries)


def test_a_bad_split_chains_value_is_one_clear_sentence(monkeypatch):
    monkeypatch.setenv("MCORE_OFFLOAD_SPLIT_CHAINS", "yes")
    with pytest.raises(ValueError, match=r"MCORE_OFFLOAD_SPLIT_CHAINS='yes' is not one of 0, 1; unset it"):
        manager_module.OffloadManager()


def test_the_runtime_switch_turns_the_split_off_and_on_between_steps(monkeypatch):
    """benchmarks/runtime_switch.py (``sw_`` runs): the split's cost is measured against its absence in one process."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from runtime_switch import RuntimeSwitch, parse_settings

    manager_module.reset()
    manager = manager_module.get_manager()
    assert manager.split_chains is True  # the default
    switch = RuntimeSwitch(parse_settings(["split_chains=0"]))
    held = []
    for under_test in (True, False, True):
        switch.start_step(under_test)
        held.append(manager.split_chains)
        switch.end_step()
    assert held == [False, True, False]
    assert switch.held == [{"split_chains": "0"}, {"split_chains": "1"}, {"split_chains": "0"}]
    with pytest.raises(ValueError, match="split_chains must be one of 1, 0"):
        parse_settings(["split_chains=on"])


def _switch_transport_setting(monkeypatch, variable, default, setting, made, read):
    """Three steps of benchmarks/runtime_switch.py with ``setting`` under test (first and third) on one stand-in
    transport ``made``: per step, ``read(made)`` and the variable's value as the runtime reads it; and the switch."""
    from mcore_offload.runtime import transport as transport_module

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from runtime_switch import RuntimeSwitch, parse_settings

    manager_module.reset()
    monkeypatch.setenv(variable, default)  # set here so that the switch's own setting is undone after the test
    monkeypatch.setattr(transport_module, "_TRANSPORTS", {"cuda:0": made})
    switch = RuntimeSwitch(parse_settings([setting]))
    seen = []
    for under_test in (True, False, True):
        switch.start_step(under_test)
        seen.append(read(made))
        switch.end_step()
    return seen, switch


def test_the_runtime_switch_bounds_the_copy_out_bursts_in_flight_between_steps(monkeypatch):
    """benchmarks/runtime_switch.py ``d2h_in_flight``: the bound of MCORE_OFFLOAD_D2H_IN_FLIGHT set on every transport
    made so far, and in the variable for those made later; the runtime's own value back in the other steps."""
    from types import SimpleNamespace

    from mcore_offload.runtime import transport as transport_module

    seen, switch = _switch_transport_setting(
        monkeypatch, transport_module.D2H_IN_FLIGHT_VARIABLE, "0", "d2h_in_flight=1", SimpleNamespace(d2h_in_flight=0),
        lambda made: (made.d2h_in_flight, transport_module.d2h_in_flight_from_env()))
    assert seen == [(1, 1), (0, 0), (1, 1)]
    assert switch.held == [{"d2h_in_flight": "1"}, {"d2h_in_flight": "0"}, {"d2h_in_flight": "1"}]
    from runtime_switch import parse_settings

    with pytest.raises(ValueError, match="d2h_in_flight must be one of 0, 1, 2, 4"):
        parse_settings(["d2h_in_flight=3"])


def test_the_runtime_switch_makes_forward_ends_wait_for_the_copies_between_steps(monkeypatch):
    """benchmarks/runtime_switch.py ``forward_end``: MCORE_OFFLOAD_FORWARD_END set on every transport made so far, and
    in the variable for those made later; hand-over back in the other steps."""
    from types import SimpleNamespace

    from mcore_offload.runtime import transport as transport_module

    seen, switch = _switch_transport_setting(
        monkeypatch, transport_module.FORWARD_END_VARIABLE, "hand-over", "forward_end=wait",
        SimpleNamespace(wait_at_forward_end=False),
        lambda made: (made.wait_at_forward_end, transport_module.forward_end_from_env()))
    assert seen == [(True, "wait"), (False, "hand-over"), (True, "wait")]
    assert switch.held == [{"forward_end": "wait"}, {"forward_end": "hand-over"}, {"forward_end": "wait"}]
    from runtime_switch import parse_settings

    with pytest.raises(ValueError, match="forward_end must be one of hand-over, wait"):
        parse_settings(["forward_end=late"])
