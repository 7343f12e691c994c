"""benchmarks/step_floor.py: each phase's fastest steps, for block, window and plain runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import step_floor  # noqa: E402
from paired_steps import block_on_steps  # noqa: E402


def write_run(tmp_path: Path, name: str, args: dict, step_ms: list[float], on_steps: list[bool] | None = None) -> str:
    row = {"rank": 0, "step_ms": step_ms}
    if on_steps is not None:
        row["alternation"] = {"on_steps": on_steps}
    path = tmp_path / name
    path.write_text(json.dumps({"args": args, "ranks": [row]}))
    return str(path)


def block_run(tmp_path: Path, plain_by_position: list[float]) -> str:
    """45 steps, warm-up 5, blocks of 5: offloaded steps 110 ms, plain ones ``plain_by_position[pos]`` by position
    in their block, every block's first step 300 ms (a switch's cost), steps 20-29 a slow period (x1.5)."""
    on = block_on_steps(45, 5, 5)
    steps = []
    for i, o in enumerate(on):
        pos = 0
        while pos < i and on[i - pos - 1] == o:
            pos += 1
        t = 110.0 if o else plain_by_position[pos]
        if i >= 5 and pos == 0:
            t = 300.0
        steps.append(t * (1.5 if 20 <= i < 30 else 1.0))
    return write_run(tmp_path, "blk.json", {"warmup_steps": 5, "alternate_offload": True, "alternate_block": 5,
                                            "alternate_period": 2}, steps, on)


def test_block_run_floors_leave_out_switch_steps_and_slow_periods(tmp_path):
    out = step_floor.run_floor(block_run(tmp_path, [100.0] * 5), positions=True)
    off, plain = out["phases"]["offloaded"], out["phases"]["plain"]
    assert off["min"] == 110.0 and off["q10"] == 110.0
    assert plain["min"] == 100.0 and plain["q25"] == 100.0
    # a slow period lifts the median only if it covers half the steps; the switch steps (300) never count
    assert max(off["median"], plain["median"]) < 300.0
    # steps 5-44: eight blocks of five, each less its first step
    assert plain["n"] == off["n"] == 16
    assert plain["min_by_position"][0] is None
    assert plain["min_by_position"][1:] == [100.0] * 4


def test_by_position_tells_a_fading_offset_from_a_flat_one(tmp_path):
    fading = step_floor.run_floor(block_run(tmp_path, [0.0, 108.0, 104.0, 101.0, 100.0]), positions=True)
    assert fading["phases"]["plain"]["min_by_position"] == [None, 108.0, 104.0, 101.0, 100.0]
    flat = step_floor.run_floor(block_run(tmp_path, [0.0, 106.0, 106.0, 106.0, 106.0]), positions=True)
    assert flat["phases"]["plain"]["min_by_position"] == [None, 106.0, 106.0, 106.0, 106.0]


def test_window_run_has_before_offloaded_and_after(tmp_path):
    steps = [500.0, 500.0] + [100.0] * 8 + [150.0, 150.0] + [110.0] * 10 + [140.0, 140.0] + [101.0] * 6
    path = write_run(tmp_path, "mid.json", {"warmup_steps": 2, "offload_from_step": 10, "offload_first_steps": 22},
                     steps)
    phases = step_floor.run_floor(path)["phases"]
    assert set(phases) == {"before", "offloaded", "after"}
    assert phases["before"]["min"] == 100.0 and phases["before"]["n"] == 8
    assert phases["offloaded"]["min"] == 110.0 and phases["offloaded"]["median"] == 110.0  # the two settling steps out
    assert phases["after"]["min"] == 101.0 and phases["after"]["n"] == 6


def test_plain_run_counts_every_step_after_the_warm_up(tmp_path):
    path = write_run(tmp_path, "base.json", {"warmup_steps": 3}, [900.0, 900.0, 900.0, 120.0, 100.0, 130.0, 110.0])
    phases = step_floor.run_floor(path)["phases"]
    assert phases == {"all": {"n": 4, "min": 100.0, "q10": 100.0, "q25": 110.0, "median": 115.0}}


def test_missing_rank_is_one_clear_sentence(tmp_path):
    path = write_run(tmp_path, "base.json", {"warmup_steps": 0}, [1.0, 2.0])
    with pytest.raises(SystemExit, match=r"has no rank 3: pass --rank with one of \[0\]"):
        step_floor.run_floor(path, rank=3)


def test_cli_prints_and_writes_json(tmp_path, capsys):
    path = block_run(tmp_path, [100.0] * 5)
    out_json = tmp_path / "floor.json"
    assert step_floor.main([path, "--by-position", "--json-out", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "offloaded" in printed and "min by position - 100.0 100.0 100.0 100.0" in printed
    rows = json.loads(out_json.read_text())
    assert rows[0]["phases"]["plain"]["min"] == 100.0


def test_host_at_floor_reads_the_fastest_steps_of_each_phase(tmp_path):
    path = block_run(tmp_path, [100.0] * 5)
    data = json.loads(Path(path).read_text())
    row = data["ranks"][0]
    n = len(row["step_ms"])
    # issue time and CPU track the step time, except that the plain steps' main thread uses 10 ms less CPU
    on = row["alternation"]["on_steps"]
    row["issue_ms"] = [t - 50 for t in row["step_ms"]]
    row["host_clock"] = {"thread_cpu_ms": [t / 2 - (0 if on[i] else 10) for i, t in enumerate(row["step_ms"])],
                         "process_cpu_ms": [t - 50 for t in row["step_ms"]]}
    row["host_clock"]["process_cpu_ms"][n - 1] = None  # a step without a reading is left out
    Path(path).write_text(json.dumps(data))
    phases = step_floor.run_floor(path, host=3)["phases"]
    assert phases["offloaded"]["host_at_floor"] == {"issue_ms": 60.0, "thread_cpu_ms": 55.0, "process_cpu_ms": 60.0}
    assert phases["plain"]["host_at_floor"] == {"issue_ms": 50.0, "thread_cpu_ms": 40.0, "process_cpu_ms": 50.0}
    assert "host_at_floor" not in step_floor.run_floor(path)["phases"]["plain"]


def test_host_columns_without_a_host_clock_say_so(tmp_path, capsys):
    path = block_run(tmp_path, [100.0] * 5)
    assert step_floor.main([path, "--host", "4"]) == 0
    assert "fastest 4: no host clock" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        step_floor.main([path, "--host", "-1"])


def test_a_json_without_its_warm_up_is_refused_not_guessed(tmp_path):
    path = write_run(tmp_path, "bare.json", {}, [1.0, 2.0])
    with pytest.raises(SystemExit, match="has no args.warmup_steps: it is not a pretrain_gpt.py result JSON"):
        step_floor.run_floor(path)
