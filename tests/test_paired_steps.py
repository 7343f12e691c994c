"""The paired step-time arithmetic of alternating runs (``benchmarks/paired_steps.py``) and issue 5's
ours-over-native verdicts (``benchmarks/overhead_ratio.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_paired_overhead_cancels_linear_drift_and_bounds_the_median():
    from paired_steps import alternation_summary, paired_ratios

    # plain steps drift 100 -> 118 ms linearly; offloaded steps cost 5 % more than the drift line at their place
    steps = [100 + 2 * i for i in range(10)]
    on = [i % 2 == 0 for i in range(10)]
    timed = [t * 1.05 if o else t for t, o in zip(steps, on)]
    ratios = paired_ratios(timed, on, first=2)
    # steps 4, 6, 8: step 2's left neighbour is a warm-up step, and a one-sided ratio would keep the drift
    assert len(ratios) == 3 and all(r == pytest.approx(1.05) for r in ratios)
    assert len(paired_ratios(timed + [200.0], on + [True], first=2)) == 3  # the last step has no right neighbour
    assert len(paired_ratios(timed + [200.0, 300.0], on + [True, False], first=2)) == 4
    peaks = [1000 if o else 1500 for o in on]
    got = alternation_summary(timed, on, 2, peaks)
    assert got["pairs"] == 3 and got["paired_overhead_pct"] == pytest.approx(5.0)
    lo, hi = got["paired_overhead_ci95_pct"]
    assert lo <= got["paired_overhead_pct"] <= hi
    assert got["delta_peak_bytes"] == 500
    assert "issue_ms_on_median" not in got
    # the host's issue time, split the same way (counted steps only: 2..9)
    issue = [50.0 + i if o else 40.0 + i for i, o in enumerate(on)]
    got = alternation_summary(timed, on, 2, peaks, issue)
    assert (got["issue_ms_on_median"], got["issue_ms_off_median"]) == (55.0, 46.0)  # steps 2-8 / 3-9


def _parity_run(period: int, n: int = 61) -> tuple[list[float], list[bool]]:
    """Step times with a parity effect (even plain steps 5 % faster than odd ones), offloaded steps 10 % above the
    plain time of their own parity, and +2 % on the plain step right after an offloaded one."""
    on = [i % period == 0 for i in range(n)]
    steps = []
    for i in range(n):
        t = (95.0 if i % 2 == 0 else 100.0) * (1.10 if on[i] else 1.0)
        steps.append(t * 1.02 if i and on[i - 1] and not on[i] else t)
    return steps, on


def test_period_three_cancels_a_step_parity_effect_and_measures_it():
    """Period 2 books a parity effect as a saving (offloaded steps are the even ones); period 3 cancels it in every
    value and reports it, with the work left to the step after an offloaded one, from the plain twos."""
    from paired_steps import alternation_summary, first_counted_step, pair_values, paired_ratios

    assert [first_counted_step(w) for w in (0, 1, 2, 3)] == [1, 1, 3, 3]  # period 2: as before
    assert [first_counted_step(w, 3) for w in (0, 1, 2, 3, 4)] == [2, 2, 2, 5, 5]
    steps, on = _parity_run(2)
    two = alternation_summary(steps, on, first_counted_step(1))
    assert two["paired_overhead_pct"] == pytest.approx(100 * (0.95 * 1.10 / 1.02 - 1), abs=0.01)  # biased low
    assert "plain_steps" not in two  # period 2 has no adjacent plain steps
    steps, on = _parity_run(3)
    first = first_counted_step(1, 3)
    # the on steps alternate between parities: each value is a two's geometric mean, the parity gone
    ratios, values = paired_ratios(steps, on, first), pair_values(steps, on, first)
    assert len(values) == len(ratios) // 2 and len({round(v, 9) for v in values}) == 1
    three = alternation_summary(steps, on, first)
    # the +2 % step after is a plain neighbour: (1.10 / 1.01) is what a paired ratio can see, the 2 % is reported
    assert three["paired_overhead_pct"] == pytest.approx(100 * (1.10 / 1.01 - 1), abs=0.01)
    plain = three["plain_steps"]
    assert plain["even_over_odd_pct"] == pytest.approx(-5.0) and plain["after_offloaded_pct"] == pytest.approx(2.0)
    assert plain["plain_twos"] == 2 * len(values)
    # no parity effect, no spill-over: both periods give the 10 %
    flat = [110.0 if i % 3 == 0 else 100.0 for i in range(61)]
    assert alternation_summary(flat, [i % 3 == 0 for i in range(61)], first)["paired_overhead_pct"] == 10.0


def _alternating_json(path, rank_overheads: dict[int, list[float]], period: int = 2) -> str:
    """An alternating run's JSON as pretrain_gpt.py writes it (one warm-up step): per rank, plain steps at 100 ms
    and each counted offloaded step ``1 + overhead`` times that."""
    ranks = []
    for rank, overheads in rank_overheads.items():
        steps = [100.0] * period  # step 0 (offloaded, warm-up), then plain ones up to the first counted
        for o in overheads:
            steps += [100.0 * (1 + o)] + [100.0] * (period - 1)
        ranks.append({"rank": rank, "step_ms": steps, "alternation": {"on_steps": [i % period == 0 for i in
                                                                                   range(len(steps))]}})
    # period 3: two warm-up steps, where only the period's own first counted step (2, not 3) counts step 3
    args = {"warmup_steps": 1} if period == 2 else {"warmup_steps": 2, "alternate_period": period}
    path.write_text(json.dumps({"args": args, "ranks": ranks}))
    return str(path)


def test_overhead_ratio_interval_and_verdicts(tmp_path):
    """The ⅓-of-native line is judged on the ratio's own bootstrap interval: met, not met, or unresolved."""
    from overhead_ratio import compare, run_pairs
    from paired_steps import overhead_ratio_interval

    ratio, lo, hi = overhead_ratio_interval([1.05] * 20, [1.30] * 20)
    assert ratio == pytest.approx(1 / 6) and lo == pytest.approx(1 / 6) and hi == pytest.approx(1 / 6)
    spread = [1.0 + 0.01 * i for i in range(21)]  # ours' median overhead 10 %, from 0 to 20 %
    ratio, lo, hi = overhead_ratio_interval(spread, [1.30] * 21)
    assert ratio == pytest.approx(1 / 3) and lo < ratio < hi
    with pytest.raises(ValueError, match="means nothing"):
        overhead_ratio_interval([1.05], [0.99, 1.0, 1.01])
    with pytest.raises(ValueError, match="alternation pairs"):
        overhead_ratio_interval([], [1.3])

    wide = [0.01 * i for i in range(21)]  # median 10 %: a third of 30 %, the interval on both sides of it
    ours = _alternating_json(tmp_path / "ours.json", {0: [0.05] * 15, 1: [0.12] * 15, 2: wide})
    native = _alternating_json(tmp_path / "native.json", {0: [0.30] * 15, 1: [0.30] * 15, 2: [0.30] * 21})
    assert len(run_pairs(ours)[0]) == 15
    rows = {r["rank"]: r for r in compare([ours], [native], 1 / 3)}
    assert rows[0]["verdict"] == "met" and rows[0]["ratio"] == pytest.approx(0.167, abs=1e-3)
    assert rows[1]["verdict"] == "not met" and rows[1]["ratio"] == pytest.approx(0.4)
    assert rows[2]["verdict"] == "unresolved" and rows[2]["ratio_ci95"][0] < 1 / 3 < rows[2]["ratio_ci95"][1]
    # a period-3 run is read with its own first counted step and its twos of opposite parity
    third = _alternating_json(tmp_path / "p3.json", {0: [0.05] * 16, 1: [0.12] * 16, 2: [0.2] * 16}, period=3)
    assert run_pairs(third)[0] == pytest.approx([1.05] * 8)  # 16 ratios of alternating parity in twos
    assert {r["rank"]: r["verdict"] for r in compare([third], [native], 1 / 3)} == {0: "met", 1: "not met",
                                                                                   2: "not met"}
    # pooling a second run per side doubles the pairs; mixing ranks is refused
    assert compare([ours, ours], [native], 1 / 3)[0]["pairs_ours"] == 30
    one_rank = _alternating_json(tmp_path / "one.json", {0: [0.3] * 15})  # ranks 0 only, against 0-2
    with pytest.raises(ValueError, match="different ranks"):
        compare([ours], [one_rank], 1 / 3)
    # the picture of such rows: one line per rank, drawn where matplotlib is installed
    rows_file = tmp_path / "D-x.json"
    rows_file.write_text(json.dumps({"rows": compare([ours], [native], 1 / 3)}))
    from overhead_ratio import plot

    pytest.importorskip("matplotlib")
    assert plot([str(rows_file)], str(tmp_path / "r.png")) and (tmp_path / "r.png").stat().st_size > 0
    # a run without alternation data: one sentence naming the flag
    (tmp_path / "plain.json").write_text(json.dumps({"args": {"warmup_steps": 1}, "ranks": [{"rank": 0}]}))
    with pytest.raises(ValueError, match="--alternate-offload"):
        run_pairs(str(tmp_path / "plain.json"))


def test_one_variants_pooled_overhead_against_a_percent_line(tmp_path):
    """``overhead_ratio.py --overhead``: a floor's or ours' runs pooled per rank, judged on the median's bootstrap
    interval against issue 5's +2 % line: under, above, or unresolved."""
    import subprocess

    from overhead_ratio import pooled_overhead

    wide = [0.001 * i for i in range(41)]  # median +2 %, spread from 0 to 4 %
    a = _alternating_json(tmp_path / "a.json", {0: [0.010] * 15, 1: [0.036] * 15, 2: wide})
    b = _alternating_json(tmp_path / "b.json", {0: [0.012] * 15, 1: [0.030] * 15, 2: wide})
    rows = {r["rank"]: r for r in pooled_overhead([a, b], 2.0)}
    assert rows[0]["verdict"] == "under" and rows[0]["pairs"] == 30 and rows[0]["overhead_pct"] == pytest.approx(1.1)
    assert rows[1]["verdict"] == "above" and rows[1]["overhead_ci95_pct"][0] > 2.0
    lo, hi = rows[2]["overhead_ci95_pct"]
    assert rows[2]["verdict"] == "unresolved" and lo < 2.0 < hi
    assert pooled_overhead([a, b], 1.05)[0]["verdict"] == "unresolved"  # the line is the caller's: inside 1.0-1.2
    short = _alternating_json(tmp_path / "s.json", {0: [0.02]})
    with pytest.raises(ValueError, match="an interval needs two"):
        pooled_overhead([short], 2.0)
    out = tmp_path / "rows.json"
    script = str(ROOT / "benchmarks" / "overhead_ratio.py")
    proc = subprocess.run([sys.executable, script, "--overhead", a, b, "--json-out", str(out)], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "above" in proc.stdout, proc.stderr
    assert [r["verdict"] for r in json.loads(out.read_text())["rows"]] == ["under", "above", "unresolved"]
    proc = subprocess.run([sys.executable, script, "--overhead", a, "--native", b], capture_output=True, text=True)
    assert proc.returncode == 2 and "one variant" in proc.stderr
