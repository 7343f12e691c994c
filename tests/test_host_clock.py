"""benchmarks/host_clock.py: the per-step record of what the host machine did (steal, load, the thread's CPU time)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import host_clock  # noqa: E402

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
        t_end = time.perf_counter() + 0.05
        if work == "spin":
            while time.perf_counter() < t_end:
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
