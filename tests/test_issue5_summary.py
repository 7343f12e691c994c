"""issue5_host.sh's closing summary (its Python, run here on hand-made run JSON)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def summary_of(tmp_path, runs: dict[str, list[dict]]) -> str:
    """What the summary prints for runs given as stem -> rank rows."""
    script = (ROOT / "benchmarks" / "gpu" / "issue5_host.sh").read_text()
    summary = script.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    folder = tmp_path / "runs"
    folder.mkdir()
    for stem, rows in runs.items():
        (folder / f"{stem}.json").write_text(json.dumps({"args": {}, "ranks": rows}))
    proc = subprocess.run([sys.executable, "-", str(folder)], input=summary, capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def row(rank: int, losses: list, steps: list[float] | None = None) -> dict:
    steps = steps or [400.0] * len(losses)
    return {"rank": rank, "step_ms": steps, "issue_ms": steps, "loss_hex": losses}


def test_losses_are_compared_on_the_last_pipeline_stage(tmp_path):
    """Under PP rank 0 has no losses: comparing its Nones said "equal" for any run (sessions 24-27's summaries)."""
    none = [None] * 8
    out = summary_of(tmp_path, {
        "baseline-none-1": [row(0, none), row(1, ["0x1p+0"] * 8)],
        "same-none-1": [row(0, none), row(1, ["0x1p+0"] * 8)],
        "other-none-1": [row(0, none), row(1, ["0x1p+0"] * 7 + ["0x1p+1"])],
        "silent-none-1": [row(0, none), row(1, none)],
    })
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(" ")}
    assert "loss equal True" in lines["same-none-1"]
    assert "loss equal False" in lines["other-none-1"]
    assert "loss equal no losses" in lines["silent-none-1"]
    assert "loss equal -" in lines["baseline-none-1"]


def test_the_slow_and_fast_thirds_are_printed_from_the_host_clock(tmp_path):
    n = 17
    r = row(0, [None] * n, [900.0] * 5 + [350.0] * 6 + [470.0] * 6)
    r["host_clock"] = {"thread_cpu_ms": [200.0] * n, "process_cpu_ms": [400.0] * n,
                       "steal_ms": [0.0] * 11 + [100.0] * 6, "busy_cpus": [2.0] * n, "involuntary_switches": [3] * n}
    out = summary_of(tmp_path, {"baseline-none-1": [r]})
    assert "slow / fast third: issue_ms 470.0/350.0" in out and "steal_ms 100.0/0.0" in out


def test_an_alternating_run_prints_its_worst_and_median_offloaded_peaks_and_the_trailing_copies(tmp_path):
    """Session 83: the worst offloaded step set "delta peak" at 750 MiB where most steps freed 1424; the line now
    shows both, and the largest copy-out still running at a chunk's forward end."""
    mib = 2**20
    r = row(0, [None] * 6)
    on = [True, False] * 3
    r["alternation"] = {"pairs": 2, "paired_overhead_pct": 2.9, "paired_overhead_ci95_pct": [2.1, 4.1],
                        "step_ms_on_median": 323.6, "step_ms_off_median": 312.4, "on_steps": on,
                        "step_peaks": [9243 * mib, 10667 * mib, 9917 * mib, 10667 * mib, 9243 * mib, 10667 * mib],
                        "peak_bytes_off_max": 10667 * mib, "delta_peak_bytes": 750 * mib}
    r["trailing_mib_max"] = 674.0
    out = summary_of(tmp_path, {"alt_attn-none-1": [r]})
    assert "delta peak 750 MiB (median offloaded step 1424 MiB)" in out
    assert "trailing max 674.0 MiB" in out
