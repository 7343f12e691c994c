"""MCORE_OFFLOAD_AUTO_HOST_BUDGET: the share of the plain step that ``auto``'s chosen groups may cost in exposed host
time. A larger share must buy at least as much of the peak, the record must keep the share so that a replay prices
the plan against the right step, and a bad value is one sentence."""

from __future__ import annotations

import dataclasses

import pytest

from mcore_offload.config import validate_offload_modules
from mcore_offload.runtime.auto import HOST_BUDGET_VARIABLE, AutoPlanner, host_budget_setting
from mcore_offload.runtime.auto_choice import HOST_BUDGET, ChunkProfile, HostCost, choose, host_cost
from mcore_offload.runtime.auto_record import from_record, to_record
from tests.test_auto import _probe

MiB = 2**20
CA = ("core_attn", "attn_proj")


def test_the_variable_scales_the_budget_and_a_bad_value_is_one_sentence(monkeypatch):
    assert host_budget_setting() == HOST_BUDGET  # unset: the default
    default = _probe({(None, 1, "core_attn"): 16 * MiB})[1][-1].host
    monkeypatch.setenv(HOST_BUDGET_VARIABLE, "0.045")
    assert AutoPlanner(None).host_budget == 0.045
    wider = _probe({(None, 1, "core_attn"): 16 * MiB})[1][-1]
    assert wider.host.budget_share == 0.045
    assert wider.host.budget_ms == pytest.approx(3 * default.budget_ms, rel=1e-3)  # the probe reads a real clock
    assert "(4.5 % of the step)" in wider.describe()  # the plan line says the budget is not the default
    assert "% of the step)" not in dataclasses.replace(wider, host=default).describe()
    for bad, says in (("-0.1", "is not a number of at least 0"), ("lots", "is not a number of at least 0"),
                      ("1.5", "is a share of the step and must be under 1")):
        monkeypatch.setenv(HOST_BUDGET_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"{HOST_BUDGET_VARIABLE}=.* {says}"):
            AutoPlanner(None)
        # the config's validation reads it too: the run stops when the config is made, not at its first forward
        with pytest.raises(ValueError, match=f"{HOST_BUDGET_VARIABLE}=.* {says}"):
            validate_offload_modules(["auto:40"])
    validate_offload_modules(["core_attn"])  # a run without auto does not read auto's variables


def test_a_larger_share_buys_at_least_as_much_of_the_peak():
    """Eight layers of 40 MiB, each group 1 ms of exposed host time on a 400 ms step: 1.5 % buys six, 3 % all."""
    prof = ChunkProfile(layer_ms={layer: 5.0 for layer in range(1, 9)}, tail_ms=5.0,
                        unit_bytes={(layer, CA): 40 * MiB for layer in range(1, 9)})
    units = {None: {(layer, CA) for layer in range(1, 9)}}
    savings = []
    for share in (0.0, HOST_BUDGET, 2 * HOST_BUDGET):
        host = host_cost(runtime_ms=8.0, wall_ms=408.0, exposure=1.0, microbatches={None: 1}, unit_layers=units,
                         outside_clock=0.0, budget_share=share)
        host = dataclasses.replace(host, gib_ms=0.0)  # host time only, so that the arithmetic above holds
        assert host.budget_ms == pytest.approx(share * 400.0)
        savings.append(choose({None: prof}, link_GBps=1000.0, need_bytes=None, host=host).expected_saving_bytes)
    assert savings == [0, 6 * 40 * MiB, 8 * 40 * MiB]


def test_the_record_keeps_the_share_and_reads_records_made_before_it():
    prof = ChunkProfile(layer_ms={1: 5.0, 2: 5.0}, tail_ms=5.0, unit_bytes={(1, CA): 40 * MiB})
    host = HostCost(exposure=1.0, group_ms=1.0, budget_ms=12.0, microbatches={None: 1}, budget_share=0.03)
    plan = choose({None: prof}, 1000.0, None, host)
    rec = to_record({None: prof}, host, 1000.0, None, None, plan)
    assert from_record(rec)[1].budget_share == 0.03
    del rec["host"]["budget_share"]  # a session-70 record: written when the share was always HOST_BUDGET
    assert from_record(rec)[1].budget_share == HOST_BUDGET


def test_the_replay_prices_a_plan_against_the_step_the_record_was_made_on():
    """auto_replay reads the plain step as budget_ms / budget_share: with 3 % of a 400 ms step (12 ms), 400 ms."""
    from benchmarks.auto_replay import replay

    prof = ChunkProfile(layer_ms={1: 5.0, 2: 5.0}, tail_ms=5.0, unit_bytes={(1, CA): 40 * MiB})
    host = HostCost(exposure=1.0, group_ms=1.0, budget_ms=12.0, microbatches={None: 1}, budget_share=0.03)
    rec = to_record({None: prof}, host, 1000.0, None, None, choose({None: prof}, 1000.0, None, host))
    out = replay(rec, [1.0])
    assert out["plain_step_ms"] == pytest.approx(400.0) and out["replay_matches"]
    assert out["budgets"][0]["host_pct_of_step"] == pytest.approx(100 * 1.0 / 400.0)
