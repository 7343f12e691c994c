"""Exploratory, written after session 75's lease: does the points' cost read higher after a run that moved bytes?

Every committed run of the offload points with nothing moved (the ``hooks`` variants, not their breakdown, native
or piece-by-piece forms), its paired overhead, the run that ended last before it started (from each run's
``host_clock`` start times), whether that run moved bytes over PCIe (an offloading or ``dmaload`` variant), and the
gap in minutes. Run from the repository root:

    python benchmarks/results/issue5-session75/run_order.py > benchmarks/results/issue5-session75/run-order.txt
"""

from __future__ import annotations

import glob
import json
import os

MOVING = ("core_attn", "attn", "experts", "all5", "auto", "dmaload")
NOT_THE_POINTS_ALONE = ("nopack", "nonode", "bare", "native", "_bd", "breakdown")


def moved_bytes(path: str) -> bool:
    name = os.path.basename(path)
    if any(k in name for k in ("hooks", "baseline", "delay")):
        return False
    return any(k in name for k in MOVING)


def load_runs() -> list[tuple[float, float, str, dict]]:
    """(start, end, path, rank 0's row) of every run with host_clock start times, by start."""
    runs = []
    for path in glob.glob("benchmarks/results/**/*-none-*.json", recursive=True):
        try:
            row = json.load(open(path))["ranks"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        starts = (row.get("host_clock") or {}).get("start_unix")
        if starts:
            runs.append((starts[0], starts[-1] + row["step_ms"][-1] / 1e3, path, row))
    return sorted(runs, key=lambda r: r[0])


def main() -> None:
    runs = load_runs()
    print("run | paired overhead % [95 %] | the run before it | moved bytes | gap, minutes")
    for i, (start, _end, path, row) in enumerate(runs):
        name = os.path.basename(path)
        if "hooks" not in name or any(k in name for k in NOT_THE_POINTS_ALONE):
            continue
        alt = row.get("alternation") or {}
        before = [r for r in runs[:i] if r[1] <= start + 1]
        prev = max(before, key=lambda r: r[1]) if before else None
        print(" | ".join(str(v) for v in (
            path.split("results/")[1], alt.get("paired_overhead_pct"), alt.get("paired_overhead_ci95_pct"),
            prev[2].split("results/")[1] if prev else None, moved_bytes(prev[2]) if prev else None,
            round((start - prev[1]) / 60, 1) if prev else None)))


if __name__ == "__main__":
    main()
