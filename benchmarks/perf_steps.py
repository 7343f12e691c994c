"""Where an offloaded step's extra host time goes, by thread, library, function and Python frame, from ``perf``.

Why: the runtime's own clock sees about half of what offloading adds to a launch-bound step (session 41), and the
stack sampler (``stack_sampler.py``) sees only the main thread's Python. ``perf record`` samples every thread of both
ranks, in every library (the CUDA driver, the caching allocator, the interpreter, our C++ module, the kernel), so the
same alternating run (``pretrain_gpt.py --alternate-offload``) splits into offloaded and plain steps sample by
sample: each sample goes to the step whose window (``host_clock.start_monotonic`` plus ``step_ms``) holds its time.

On the GPU host (``benchmarks/gpu/issue5_host.sh`` with ``LAUNCH_PREFIX``)::

    LAUNCH_PREFIX="perf record -e cpu-clock -c 1000000 -g -k mono -o /tmp/r/@TAG@.perf.data --" ...
    PYTHONPERFSUPPORT=1  # Python 3.12: Python functions appear in the call chains as py::NAME:FILE
    perf script -i RUN.perf.data -F comm,pid,tid,time,ip,sym,dso | \\
        python3 benchmarks/perf_steps.py RUN.json --period-ns 1000000 --json-out RUN.perf.json

Each figure is milliseconds of CPU a step (samples times ``--period-ns``, over the steps of that kind after the
warm-up), for offloaded (``on``) and plain (``off``) steps and their difference, with its standard error from the
sample counts (Poisson). ``self`` keys are where the sample was taken (library:function); ``incl`` keys count a
sample once for each library on its call chain (a lower bound: chains stop at libraries built without frame
pointers); ``python`` keys are the innermost Python function on the chain (Python 3.12 marks only the functions
entered from C, so this is the Python function whose call from C leads to the sample). Samples with our C++
module on the chain also count under ``ours-entry`` (the outermost of its functions on the chain), ``ours-caller``
(the Python function above that), ``ours-python`` (the innermost Python function below it: what our C++ called back
into, or ``(none)``) and ``under-ours`` (where the sample was taken). Benchmark tooling only.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

HEADER = re.compile(r"^\s*(?P<comm>.*?)\s+(?P<pid>\d+)/(?P<tid>\d+)\s+(?P<time>\d+\.\d+):(?P<rest>.*)$")
FRAME = re.compile(r"^\s*[0-9a-f]+\s+(?P<sym>.*?)\s+\((?P<dso>[^()]*)\)\s*$")
OUR_MODULE = "mcore_offload_hooks"  # the C++ runtime's shared object (runtime/native/__init__.py's build_name)


def read_samples(lines: Iterable[str]) -> Iterator[tuple[str, int, int, float, list[tuple[str, str]]]]:
    """``perf script -F comm,pid,tid,time,ip,sym,dso`` output as (comm, pid, tid, seconds, frames), frames innermost
    first as (symbol, library basename). With call chains (``-g``) a header line is followed by one line a frame;
    without them the one frame is on the header line."""
    head: tuple[str, int, int, float] | None = None
    frames: list[tuple[str, str]] = []
    for line in lines:
        line = line.rstrip("\n")
        m = HEADER.match(line)
        if m is None:
            f = FRAME.match(line)
            if f is not None and head is not None:
                frames.append((f["sym"], os.path.basename(f["dso"])))
            continue
        if head is not None:
            yield (*head, frames)
        head, frames = (m["comm"], int(m["pid"]), int(m["tid"]), float(m["time"])), []
        f = FRAME.match(m["rest"])
        if f is not None:
            frames.append((f["sym"], os.path.basename(f["dso"])))
    if head is not None:
        yield (*head, frames)


class RankSteps:
    """One rank's step windows on CLOCK_MONOTONIC and whether each was offloaded."""

    def __init__(self, row: dict[str, Any], warmup: int) -> None:
        clock = row.get("host_clock") or {}
        starts = clock.get("start_monotonic")
        if not starts or row.get("pid") is None:
            raise SystemExit(f"rank {row.get('rank')}: the run JSON has no start_monotonic or pid; rerun it with a "
                             "pretrain_gpt.py that records them")
        on = (row.get("alternation") or {}).get("on_steps") or [True] * len(starts)
        self.rank, self.pid = row["rank"], row["pid"]
        self.starts = starts
        self.ends = [s + ms / 1e3 for s, ms in zip(starts, row["step_ms"])]
        self.kind = ["on" if x else "off" for x in on]
        self.first = warmup
        self.steps = collections.Counter(self.kind[warmup:len(starts)])

    def kind_at(self, t: float) -> str | None:
        i = bisect.bisect_right(self.starts, t) - 1
        if i < self.first or i >= len(self.ends) or t > self.ends[i]:
            return None
        return self.kind[i]


def thread_name(comm: str, pid: int, tid: int) -> str:
    return "main" if tid == pid else re.sub(r"\d+$", "N", comm)


def sample_keys(comm: str, pid: int, tid: int, frames: list[tuple[str, str]]) -> list[str]:
    """Every key one sample counts towards (see the module's docstring)."""
    thread = thread_name(comm, pid, tid)
    keys = [f"thread {thread}"]
    if frames:
        sym, dso = frames[0]
        keys += [f"self {dso}:{sym}", f"selflib {thread} {dso}"]
    keys += [f"incl {thread} {dso}" for dso in dict.fromkeys(d for _, d in frames)]
    python = [i for i, (s, _) in enumerate(frames) if s.startswith("py::")]  # innermost first
    keys.append(f"python {thread} {frames[python[0]][0][4:] if python else '(none)'}")
    ours = [i for i, (_, d) in enumerate(frames) if OUR_MODULE in d]
    if ours:
        outer = ours[-1]  # the outermost of our functions on the chain
        called = next((frames[i][0][4:] for i in python if i < outer), "(none)")  # the Python it called back into
        caller = next((frames[i][0][4:] for i in python if i > outer), "(none)")  # the Python that called it
        keys += [f"ours {thread}", f"under-ours {thread} {dso}:{sym}", f"ours-entry {thread} {frames[outer][0]}",
                 f"ours-caller {thread} {caller}", f"ours-python {thread} {called}"]
    return keys


def aggregate(samples: Iterable[tuple[str, int, int, float, list[tuple[str, str]]]], ranks: list[RankSteps]
              ) -> dict[int, dict[str, collections.Counter]]:
    """Per rank and step kind, the sample count of every key."""
    by_pid = {r.pid: r for r in ranks}
    counts: dict[int, dict[str, collections.Counter]] = {
        r.rank: {"on": collections.Counter(), "off": collections.Counter()} for r in ranks}
    for comm, pid, tid, t, frames in samples:
        rank = by_pid.get(pid)
        kind = rank.kind_at(t) if rank is not None else None
        if kind is None:
            continue
        counts[rank.rank][kind].update(sample_keys(comm, pid, tid, frames))
    return counts


def table(counts: dict[str, collections.Counter], steps: collections.Counter, period_ns: int
          ) -> list[dict[str, Any]]:
    """Every key's ms a step on and off, their difference and its standard error; largest difference first."""
    n_on, n_off = steps.get("on", 0), steps.get("off", 0)
    ms = period_ns / 1e6
    rows = []
    for key in set(counts["on"]) | set(counts["off"]):
        c_on, c_off = counts["on"][key], counts["off"][key]
        on = c_on * ms / n_on if n_on else math.nan
        off = c_off * ms / n_off if n_off else math.nan
        se = ms * math.sqrt((c_on / n_on**2 if n_on else 0) + (c_off / n_off**2 if n_off else 0))
        rows.append({"key": key, "on_ms": round(on, 3), "off_ms": round(off, 3), "diff_ms": round(on - off, 3),
                     "se_ms": round(se, 3)})
    rows.sort(key=lambda r: (-(r["diff_ms"] if not math.isnan(r["diff_ms"]) else -1e9), r["key"]))
    return rows


def report(run: dict[str, Any], samples: Iterable, period_ns: int, top: int) -> tuple[dict[str, Any], str]:
    warmup = int((run.get("args") or {}).get("warmup_steps", 0))
    ranks = [RankSteps(row, warmup) for row in run["ranks"]]
    counts = aggregate(samples, ranks)
    out: dict[str, Any] = {"period_ns": period_ns, "ranks": {}}
    text = []
    for r in ranks:
        rows = table(counts[r.rank], r.steps, period_ns)
        out["ranks"][r.rank] = {"steps": dict(r.steps), "rows": rows}
        text.append(f"rank {r.rank} (pid {r.pid}): {r.steps.get('on', 0)} offloaded and {r.steps.get('off', 0)} "
                    f"plain steps after {warmup} warm-up; CPU ms a step")
        for prefix in ("thread", "selflib", "incl", "ours", "ours-entry", "ours-caller", "ours-python", "under-ours",
                       "python", "self"):
            chosen = [x for x in rows if x["key"].startswith(prefix + " ")]
            if prefix in ("python", "self", "under-ours"):
                chosen = chosen[:top] + [x for x in chosen[-max(top // 3, 1):] if x not in chosen[:top]]
            text.append(f"  {'key':<78}{'on':>9}{'off':>9}{'diff':>9}{'± se':>8}")
            for x in chosen:
                text.append(f"  {x['key'][:78]:<78}{x['on_ms']:>9.2f}{x['off_ms']:>9.2f}{x['diff_ms']:>+9.2f}"
                            f"{x['se_ms']:>8.2f}")
            text.append("")
    return out, "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="pretrain_gpt.py's JSON of the profiled run")
    p.add_argument("--script", default="-", help="perf script's output (default: standard input)")
    p.add_argument("--period-ns", type=int, required=True, help="perf record's -c for cpu-clock (ns a sample)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    run = json.loads(Path(args.run).read_text())
    stream = sys.stdin if args.script == "-" else open(args.script, errors="replace")
    with stream:
        out, text = report(run, read_samples(stream), args.period_ns, args.top)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
