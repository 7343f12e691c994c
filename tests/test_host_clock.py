"""benchmarks/host_clock.py, the per-step record of what the host machine did (steal, load, the thread's CPU time),
and host_periods.py, which reads it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import host_clock  # noqa: E402
import host_periods  # noqa: E402

STAT = """cpu  100 5 50 1000 7 1 2 30 0 0
cpu0 50 2 25 500 3 0 1 15 0 0
intr 123
"""


def test_proc_stat_and_status_parse_the_machine_line_and_the_involuntary_switches():
    assert host_clock.parse_proc_stat(STAT) == {"user": 100, "nice": 5, "system": 50, "idle": 1000, "iowait": 7,
                                                "irq": 1, "softirq": 2, "steal": 30}
    assert host_clock.parse_proc_stat("cpu0 1 2 3\n") is None  # a per-CPU line is not the machine's
    assert host_clock.parse_proc_stat("cpu 1 2 3 4\n")["steal"] == 0  # old kernels: fields missing at the end
    status = "Name:\tpython\nvoluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t7\n"
    assert host_clock.parse_involuntary_switches(status) == 7
    assert host_clock.parse_involuntary_switches("Name:\tpython\n") is None


def test_a_spinning_step_costs_thread_cpu_and_a_sleeping_one_does_not():
    clock = host_clock.HostClock()
    for work in ("spin", "sleep"):
        clock.start_step()
        if work == "spin":
            # until this thread has run 50 ms (not 50 ms of wall time: on a loaded machine the spinning thread is
            # descheduled part of the time, and CI once read 26 ms of CPU in 50 ms of wall)
            cpu_end, wall_end = time.thread_time() + 0.05, time.perf_counter() + 10.0
            while time.thread_time() < cpu_end and time.perf_counter() < wall_end:
                pass
        else:
            time.sleep(0.05)
        clock.issued()
        clock.end_step()
    spin, sleep = clock.thread_cpu_ms
    assert spin > 30 and sleep < 20, clock.thread_cpu_ms
    out = clock.as_dict()
    assert {len(v) for v in out.values()} == {2} and out["start_unix"][1] >= out["start_unix"][0]


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc")
def test_on_linux_the_machine_counters_are_read():
    clock = host_clock.HostClock()
    clock.start_step()
    t_end = time.perf_counter() + 0.1
    while time.perf_counter() < t_end:
        pass
    clock.issued()
    clock.end_step()
    assert clock.steal_ms[0] is not None and clock.steal_ms[0] >= 0
    assert clock.busy_cpus[0] is not None and clock.busy_cpus[0] > 0.3  # this thread spun for the whole step
    assert clock.involuntary_switches[0] is not None and clock.involuntary_switches[0] >= 0


def test_without_proc_the_machine_counters_are_none(monkeypatch):
    monkeypatch.setattr(host_clock, "_read", lambda path: None)
    clock = host_clock.HostClock()
    clock.start_step()
    clock.issued()
    clock.end_step()
    assert clock.steal_ms == [None] and clock.busy_cpus == [None] and clock.involuntary_switches == [None]
    assert clock.thread_cpu_ms[0] >= 0


def test_spearman_ranks_ties_and_refuses_constant_input():
    assert host_periods.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert host_periods.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert host_periods.spearman([1, 2, 3], [5, 5, 5]) is None
    assert host_periods.spearman([1, 1, 2, 2], [1, 1, 2, 2]) == 1.0


def test_slow_steps_with_steal_are_told_apart_from_fast_ones(tmp_path):
    """Steps 5-16 timed; the slow ones carry steal and the thread's CPU time does not move."""
    steps = [900.0] * 5 + [350.0, 351.0, 349.0, 352.0, 350.0, 348.0, 460.0, 470.0, 480.0, 455.0, 465.0, 475.0]
    steal = [0.0] * 11 + [90.0, 100.0, 110.0, 85.0, 95.0, 105.0]
    row = {"rank": 0, "step_ms": steps, "issue_ms": [s - 40 for s in steps],
           "host_clock": {"thread_cpu_ms": [200.0] * len(steps), "process_cpu_ms": [400.0] * len(steps),
                          "steal_ms": steal, "busy_cpus": [2.0] * len(steps),
                          "involuntary_switches": [None] * len(steps)}}
    got = host_periods.split_by_step_time(row, warmup=5)
    assert got["timed_steps"] == 12 and got["step_ms"]["fast"] < 352 < 455 <= got["step_ms"]["slow"]
    assert got["steal_ms"]["fast"] == 0 and got["steal_ms"]["slow"] >= 90 and got["steal_ms"]["rank_corr"] > 0.8
    assert got["thread_cpu_ms"]["rank_corr"] is None  # constant: no correlation to speak of
    assert got["involuntary_switches"] is None  # not recorded in every step
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"args": {"warmup_steps": 5}, "ranks": [row]}))
    assert host_periods.main([str(js), "--json-out", str(tmp_path / "out.json")]) == 0
    with pytest.raises(SystemExit, match="no rank 1"):
        host_periods.main([str(js), "--rank", "1"])
    del row["host_clock"]
    js.write_text(json.dumps({"args": {"warmup_steps": 5}, "ranks": [row]}))
    with pytest.raises(SystemExit, match="no host_clock"):
        host_periods.main([str(js)])

