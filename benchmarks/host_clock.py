"""Per step: what the host machine did while the training thread issued the step.

Why: on the 2x H200 host (session 27) the same plain run steps at 347 ms for a while and then at 400-520 ms for 10-40
steps, in the baseline as in every variant, and the issue time rises with the step time. Whether those slow periods
are the guest losing its CPUs (hypervisor steal), other work on the machine, or the training thread itself doing more
(a slower clock, cache contention) decides what a comparison can filter on. So each step records, outside its timed
region:

- ``start_unix``: when the step began (wall clock), to line steps up with samplers run beside the job
  (``nvidia-smi -lms``, ``vmstat``);
- ``start_monotonic``: the same instant on ``CLOCK_MONOTONIC`` (seconds), the clock of ``perf record -k mono``
  (``perf_steps.py`` gives each sample its step with it);
- ``thread_cpu_ms``: CPU time of the main thread (it issues the forward passes; PyTorch runs CUDA backward passes on
  its own device thread) from the step's start to :meth:`HostClock.issued`, before the step's closing synchronize
  (which may spin);
- ``process_cpu_ms``: CPU time of the whole process over the same span (the backward thread, NCCL's threads);
- ``steal_ms``: CPU time the hypervisor gave to others, summed over all of the machine's CPUs (``/proc/stat``);
- ``busy_cpus``: how many of the machine's CPUs were busy on average (user, system, irq, softirq: any process);
- ``involuntary_switches``: times the main thread was descheduled against its will
  (``nonvoluntary_ctxt_switches`` of ``/proc/thread-self/status``).

Where ``/proc`` is missing (not Linux) the last three are None. Benchmark tooling only.
"""

from __future__ import annotations

import os
import time

#: ``/proc/stat``'s ``cpu`` line, in order (man 5 proc)
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def parse_proc_stat(text: str) -> dict[str, int] | None:
    """The machine-wide ``cpu`` line of ``/proc/stat`` as jiffies by field, or None if there is none."""
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:1 + len(STAT_FIELDS)]]
            values += [0] * (len(STAT_FIELDS) - len(values))
            return dict(zip(STAT_FIELDS, values))
    return None


def parse_involuntary_switches(status_text: str) -> int | None:
    """``nonvoluntary_ctxt_switches`` from a ``/proc/<pid>/status`` text."""
    for line in status_text.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            return int(line.split(":", 1)[1])
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


class HostClock:
    """Call :meth:`start_step` right before a step's timed region, :meth:`issued` when its work is issued and
    :meth:`end_step` after it; read :meth:`as_dict`."""

    def __init__(self) -> None:
        self.start_unix: list[float] = []
        self.start_monotonic: list[float] = []
        self.thread_cpu_ms: list[float] = []
        self.process_cpu_ms: list[float] = []
        self.steal_ms: list[float | None] = []
        self.busy_cpus: list[float | None] = []
        self.involuntary_switches: list[int | None] = []
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._t0 = self._cpu0 = self._pcpu0 = 0.0
        self._stat0: dict[str, int] | None = None
        self._sw0: int | None = None

    def _stat(self) -> dict[str, int] | None:
        text = _read("/proc/stat")
        return None if text is None else parse_proc_stat(text)

    def _switches(self) -> int | None:
        text = _read("/proc/thread-self/status")
        return None if text is None else parse_involuntary_switches(text)

    def start_step(self) -> None:
        self._stat0, self._sw0 = self._stat(), self._switches()
        self.start_unix.append(round(time.time(), 4))
        self.start_monotonic.append(round(time.monotonic(), 6))
        self._t0, self._cpu0, self._pcpu0 = time.perf_counter(), time.thread_time(), time.process_time()

    def issued(self) -> None:
        """The step's work is issued (call before its closing synchronize)."""
        self.thread_cpu_ms.append(round((time.thread_time() - self._cpu0) * 1e3, 3))
        self.process_cpu_ms.append(round((time.process_time() - self._pcpu0) * 1e3, 3))

    def end_step(self) -> None:
        wall = time.perf_counter() - self._t0
        stat, sw = self._stat(), self._switches()
        if stat is not None and self._stat0 is not None:
            d = {k: stat[k] - self._stat0[k] for k in STAT_FIELDS}
            ms = 1e3 / self._hz
            self.steal_ms.append(round(d["steal"] * ms, 1))
            busy = d["user"] + d["nice"] + d["system"] + d["irq"] + d["softirq"]
            self.busy_cpus.append(round(busy * ms / 1e3 / wall, 2) if wall > 0 else None)
        else:
            self.steal_ms.append(None)
            self.busy_cpus.append(None)
        self.involuntary_switches.append(None if sw is None or self._sw0 is None else sw - self._sw0)

    def as_dict(self) -> dict[str, list]:
        return {"start_unix": self.start_unix, "start_monotonic": self.start_monotonic,
                "thread_cpu_ms": self.thread_cpu_ms, "process_cpu_ms": self.process_cpu_ms,
                "steal_ms": self.steal_ms, "busy_cpus": self.busy_cpus,
                "involuntary_switches": self.involuntary_switches}
