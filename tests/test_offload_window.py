"""Window runs (``pretrain_gpt.py --offload-from-step S --offload-first-steps K``): the phases' arithmetic
(``benchmarks/offload_stop.py``) and the ours-over-native ratio of two such runs (``benchmarks/overhead_ratio.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def _window_json(path, rank_offloaded: dict[int, list[float]], before: int = 6, after: int = 3,
                 plain: float = 100.0, alternation: bool = False) -> str:
    """A window run's JSON as pretrain_gpt.py writes it (one warm-up step): per rank, ``before`` plain steps after
    the warm-up, two offloaded warm-up steps at 500 ms, the given offloaded steps, two settling and ``after`` plain."""
    from offload_stop import offload_stop_summary

    ranks = []
    for rank, offloaded in rank_offloaded.items():
        start = 1 + before
        stop = start + 2 + len(offloaded)
        steps = [900.0] + [plain] * before + [500.0, 500.0] + list(offloaded) + [300.0, 300.0] + [plain] * after
        row = {"rank": rank, "step_ms": steps,
               "offload_stop": offload_stop_summary(steps, 1, start, stop, "keep")}
        if alternation:
            row["alternation"] = {"on_steps": [True] * len(steps)}
        ranks.append(row)
    path.write_text(json.dumps({"args": {"warmup_steps": 1}, "ranks": ranks}))
    return str(path)


def test_window_phases_skip_the_warm_up_and_each_switchs_first_two_steps():
    from offload_stop import offload_stop_summary, over_pct_interval, window_steps

    steps = [900.0] + [100.0] * 4 + [500.0, 500.0, 110.0, 112.0, 300.0, 300.0, 104.0]
    phases = window_steps(steps, 1, 5, 9)
    assert phases == {"before": [100.0] * 4, "offloaded": [110.0, 112.0], "after": [104.0]}
    got = offload_stop_summary(steps, 1, 5, 9, "keep")
    assert got["offloaded_over_before_pct"] == pytest.approx(11.0) and got["offloaded_steps_counted"] == 2
    assert got["after_over_before_pct"] == pytest.approx(4.0)
    lo, hi = got["offloaded_over_before_ci95_pct"]
    assert 10.0 - 1e-9 <= lo <= 11.0 <= hi <= 12.0 + 1e-9  # resampled medians of [110, 112] over 100
    assert over_pct_interval([110.0], [100.0, 100.0]) is None  # one step has no spread to resample
    # a window from step 0 has no plain steps before: no overhead against them
    got = offload_stop_summary([500.0, 500.0, 110.0, 300.0, 300.0, 100.0], 1, 0, 3, "both")
    assert got["plain_before_steps_counted"] == 0 and got["offloaded_over_before_pct"] is None


def test_window_ratio_verdicts_and_refusals(tmp_path):
    from overhead_ratio import compare_windows, run_windows, window_ratio_interval

    ours = _window_json(tmp_path / "ours.json", {0: [105.0] * 8, 1: [112.0] * 8,
                                                 2: [100.0 + i for i in range(21)]})
    native = _window_json(tmp_path / "native.json", {0: [130.0] * 8, 1: [130.0] * 8, 2: [130.0] * 21})
    off, before = run_windows(ours)[0]
    assert off == [105.0] * 8 and before == [100.0] * 6
    rows = {r["rank"]: r for r in compare_windows([ours], [native], 1 / 3)}
    assert rows[0]["verdict"] == "met" and rows[0]["ratio"] == pytest.approx(0.167, abs=1e-3)
    assert rows[0]["overhead_ours_pct"] == 5.0 and rows[0]["overhead_native_pct"] == 30.0
    assert rows[1]["verdict"] == "not met" and rows[1]["ratio"] == pytest.approx(0.4)
    assert rows[2]["verdict"] == "unresolved" and rows[2]["ratio_ci95"][0] < 1 / 3 < rows[2]["ratio_ci95"][1]
    # two runs per side: the mean of their overheads (5 % and 12 % -> 8.5 %, against 30 %)
    ratio, lo, hi = window_ratio_interval([run_windows(ours)[0], run_windows(ours)[1]], [run_windows(native)[0]])
    assert ratio == pytest.approx(8.5 / 30) and lo == hi == pytest.approx(ratio)
    with pytest.raises(ValueError, match="means nothing"):
        window_ratio_interval([(off, before)], [([99.0, 100.0], [100.0, 100.0])])
    # a run from step 0 (no plain steps before) is one sentence naming the flags
    from_zero = tmp_path / "zero.json"
    doc = json.loads(Path(ours).read_text())
    for row in doc["ranks"]:
        row["offload_stop"]["plain_before_steps_counted"] = 0
    from_zero.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="--offload-from-step S --offload-first-steps K"):
        run_windows(str(from_zero))
    # the command line reads window runs as such, and refuses mixing them with alternating runs
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead_ratio.py"), ours, native],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "met" in proc.stdout and "runs" in proc.stdout
    alternating = _window_json(tmp_path / "alt.json", {0: [130.0] * 8}, alternation=True)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead_ratio.py"), ours, alternating],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "window runs with window runs" in proc.stderr
