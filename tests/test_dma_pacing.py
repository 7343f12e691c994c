"""The time-local ratios of benchmarks/gpu/dma_pacing.py: a condition read against its nearest control windows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import dma_pacing  # noqa: E402


def drifting_sequence(effect: float) -> list[tuple[str, float]]:
    """Control and copy windows alternating while the host slows from 8 to 12 µs a unit; copies cost ``effect``."""
    seq = []
    for i in range(200):
        host = 8.0 + 4.0 * i / 199
        seq.append(("none@1", host) if i % 2 == 0 else ("both@1", host * effect))
    return seq


def test_local_ratio_finds_the_effect_under_drift() -> None:
    med, lo, hi = dma_pacing.local_ratios(drifting_sequence(1.05))["both@1"]
    assert med == pytest.approx(1.05, abs=0.005)
    assert lo <= med <= hi
    none_med, _, _ = dma_pacing.local_ratios(drifting_sequence(1.05))["none@1"]
    assert none_med == pytest.approx(1.0, abs=0.005)


def test_local_ratio_is_not_fooled_by_where_windows_fall() -> None:
    # every copy window in the slow half: a plain median against all controls would read about +17 %
    seq = [("none@1", 8.0 + 4.0 * i / 199) for i in range(0, 200, 2)]
    seq += [("both@1", 12.0) for _ in range(20)]
    med, _, _ = dma_pacing.local_ratios(seq)["both@1"]
    assert med == pytest.approx(1.0, abs=0.03)


def test_no_controls_gives_no_ratio() -> None:
    assert dma_pacing.local_ratios([("both@1", 10.0), ("both@1", 11.0)]) == {}
