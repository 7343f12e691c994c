"""What ``auto`` chose its plan from, kept as JSON (runtime/auto_record.py), and its offline replay
(benchmarks/auto_replay.py): the record must give back the same plan, and the replay must say how much of the full
set's saving each host-time budget buys."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from mcore_offload.runtime.auto_choice import HOST_BUDGET, ChunkProfile, HostCost, choose
from mcore_offload.runtime.auto_record import from_record, to_record
from mcore_offload.runtime.peak_trace import PeakTrace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import auto_replay  # noqa: E402

MiB = 2**20
CA = ("attn_proj", "core_attn")
QKV = ("qkv_linear",)


def _inputs() -> tuple[dict, HostCost, PeakTrace]:
    """Two chunks (0 and 1), three layers, two units; a plateau of two intervals that takes units of both chunks to
    lower, and a host budget that pays for three of the twelve units."""
    profiles = {}
    for vp in (0, 1):
        p = ChunkProfile(layer_ms={1: 2.0, 2: 2.0, 3: 0.0}, tail_ms=3.0)
        p.unit_bytes = {(layer, unit): (64 if unit == CA else 16) * MiB for layer in (1, 2, 3) for unit in (CA, QKV)}
        p.kept = {(4, CA)}
        profiles[vp] = p
    off0 = {(0, layer, unit): n for (layer, unit), n in profiles[0].unit_bytes.items()}
    off1 = {(1, layer, unit): n for (layer, unit), n in profiles[1].unit_bytes.items()}
    trace = PeakTrace([1700 * MiB, 1690 * MiB, 1500 * MiB], [off0, off1, {}], floor=1500 * MiB)
    host = HostCost(exposure=1.0, group_ms=1.0, budget_ms=100.0 * HOST_BUDGET * 2.2, microbatches={0: 1, 1: 1},
                    gib_ms=0.5)
    return profiles, host, trace


def test_a_record_survives_json_and_gives_back_the_same_plan():
    profiles, host, trace = _inputs()
    plan = choose(profiles, 50.0, None, host, trace=trace)
    rec = json.loads(json.dumps(to_record(profiles, host, 50.0, None, trace, plan)))
    p2, h2, link, need, t2 = from_record(rec)
    assert p2 == profiles and h2 == host and link == 50.0 and need is None
    assert t2.plain == trace.plain and t2.off == trace.off and t2.floor == trace.floor
    again = choose(p2, link, need, h2, trace=t2)
    assert again.points == plan.points and again.expected_saving_bytes == plan.expected_saving_bytes
    assert rec["plan"]["describe"] == plan.describe()
    # a chunk of None (no virtual pipeline) and the untraced path round-trip too
    flat = {None: profiles[0]}
    untraced = choose(flat, 50.0, 10 * MiB, None)
    p3, h3, _, need3, t3 = from_record(json.loads(json.dumps(to_record(flat, None, 50.0, 10 * MiB, None, untraced))))
    assert list(p3) == [None] and h3 is None and t3 is None and need3 == 10 * MiB


def test_a_record_of_another_version_is_refused_with_one_sentence():
    profiles, host, trace = _inputs()
    rec = to_record(profiles, host, 50.0, None, trace, choose(profiles, 50.0, None, host, trace=trace))
    rec["version"] = 0
    with pytest.raises(ValueError, match="replay it with the mcore-offload release that wrote it"):
        from_record(rec)


def test_the_replay_gives_the_full_set_and_what_each_budget_buys_of_it(tmp_path, capsys):
    profiles, host, trace = _inputs()
    plan = choose(profiles, 50.0, None, host, trace=trace)
    rec = to_record(profiles, host, 50.0, None, trace, plan)
    out = auto_replay.replay(rec, [0.5, 1.0, 2.0, math.inf])
    assert out["replay_matches"]
    # everything off: both plateau intervals lose all their bytes; the third (1500 MiB, nothing off) is then the peak
    assert out["full_set_saving_bytes"] == 200 * MiB
    half, one, two, free = out["budgets"]
    # half the budget pays for the kept units alone; each doubling buys more of the plateau, none of it the whole
    assert half["saving_bytes"] == 0 and half["points"] == 0
    assert 0 < one["saving_bytes"] == plan.expected_saving_bytes < two["saving_bytes"] < free["saving_bytes"]
    assert free["saving_bytes"] == 200 * MiB and free["share_of_full"] == 1.0
    # host time as a share of the plain step: the budget is HOST_BUDGET of it
    assert one["host_ms"] <= out["budget_ms"] and one["host_pct_of_step"] <= 100 * HOST_BUDGET + 1e-9
    assert free["host_ms"] > two["host_ms"] > one["host_ms"]
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"ranks": [{"rank": 0, "auto_record": rec}, {"rank": 1, "auto_record": None}]}))
    png = tmp_path / "frontier.png"
    assert auto_replay.main([str(js), "--budgets", "1", "inf", "--json-out", str(tmp_path / "r.json"),
                             "--plot", str(png), "--labels", "toy"]) == 0
    assert png.stat().st_size > 0
    text = capsys.readouterr().out
    assert "rank 0: full set 0.20 GiB" in text and "replay matches" in text and "rank 1" not in text
    assert json.loads((tmp_path / "r.json").read_text())[0]["budgets"][1]["share_of_full"] == 1.0
    js.write_text(json.dumps({"ranks": [{"rank": 0}]}))
    assert auto_replay.main([str(js)]) == 1


def test_the_replay_names_the_host_budget_that_buys_a_share_of_the_full_set(tmp_path, capsys):
    """``--want``: the smallest MCORE_OFFLOAD_AUTO_HOST_BUDGET whose replayed plan reaches each share."""
    profiles, host, trace = _inputs()
    rec = to_record(profiles, host, 50.0, None, trace, choose(profiles, 50.0, None, host, trace=trace))
    half, everything = auto_replay.budgets_for(rec, [0.5, 1.0])
    assert everything["share_of_full"] == 1.0 and 0.5 <= half["share_of_full"] < 1.0
    assert half["host_budget"] < everything["host_budget"]
    # the budget found is the smallest of the search grid that buys it: one step down buys less
    k = auto_replay.SEARCH_MULTIPLIERS.index(half["budget_x"])
    below = auto_replay.replay(rec, [auto_replay.SEARCH_MULTIPLIERS[k - 1]])["budgets"][0]
    assert below["share_of_full"] < 0.5
    # the host budget as the variable takes it: the recorded share times the multiplier
    assert half["host_budget"] == pytest.approx(host.budget_share * half["budget_x"])
    assert half["host_pct_of_step"] <= 100 * half["host_budget"] + 1e-9
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"ranks": [{"rank": 0, "auto_record": rec}]}))
    assert auto_replay.main([str(js), "--budgets", "1", "--want", "0.5", "1.0"]) == 0
    text = capsys.readouterr().out
    assert f"for 50 % of the full set: MCORE_OFFLOAD_AUTO_HOST_BUDGET={half['host_budget']:.3f}" in text
    # a rank without host figures (the CPU) has no budget to name
    cpu = to_record(profiles, None, 50.0, None, trace, choose(profiles, 50.0, None, None, trace=trace))
    assert auto_replay.budgets_for(cpu, [0.5]) == [None]
