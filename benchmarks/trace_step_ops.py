"""Which host work grows in an offloaded step? Self CPU time per op, offloaded steps against plain ones.

Reads a torch.profiler Chrome trace of an alternating run (``pretrain_gpt.py --alternate-offload --profile-steps
FIRST LAST``), whose steps are the named ranges ``bench step N on`` / ``bench step N off``. Per step, every CPU event
inside the range on any thread (the autograd engine runs backward on its own thread) is charged its self time (its
duration less its children's on the same thread), summed by name; the result is each name's mean per step in
offloaded and in plain steps, sorted by the difference. Session 30 found ours' offloaded C steps issuing ~75 ms
more host time than plain ones with ~25 ms inside the runtime's hooks: this says where the rest goes.

    python benchmarks/trace_step_ops.py trace_rank0.json[.gz] [--skip 1] [--top 30] [--json-out FILE]

Profile enough steps for the noise: each step's range is listed first, and the host's pace drifts by 10-20 % from
one step to the next on the H100 hosts, so a per-op difference from two steps a side is not a finding.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

STEP = re.compile(r"^bench step (\d+) (on|off)$")
CPU_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "python_function", "cuda_driver"}


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def self_stats(events: list[dict]) -> dict[str, list[float]]:
    """Per name on one thread: [self time µs (duration less that of the events nested in it), calls]."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    stack: list[list] = []  # [end, name, children's time, duration]

    def close(done: list) -> None:
        row = out[done[1]]
        row[0] += done[3] - done[2]
        row[1] += 1

    for ev in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        start, end = ev["ts"], ev["ts"] + ev["dur"]
        while stack and stack[-1][0] <= start:
            close(stack.pop())
        if stack:
            stack[-1][2] += ev["dur"]
        stack.append([end, ev["name"], 0.0, ev["dur"]])
    for done in stack:
        close(done)
    return out


def step_ranges(trace: dict) -> list[tuple[int, bool, float, float]]:
    """The profiled steps' ranges: (step, offloaded, start µs, end µs), in step order."""
    return sorted((int(m.group(1)), m.group(2) == "on", e["ts"], e["ts"] + e["dur"])
                  for e in trace.get("traceEvents", [])
                  # the host's range only: the profiler repeats a range on each GPU stream its kernels ran on
                  if e.get("ph") == "X" and "dur" in e and e.get("cat") == "user_annotation"
                  and (m := STEP.match(e.get("name", ""))))


def step_ops(trace: dict, skip: int = 0) -> dict[int, tuple[bool, dict[str, float], dict[str, int]]]:
    """Per profiled step, the first ``skip`` left out: (offloaded, self µs by name, calls by name), over every thread
    inside the step's range."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = step_ranges(trace)[skip:]
    starts = [start for _, _, start, _ in steps]
    # one pass over the trace (a profiled step of A holds ~10^5 events): each CPU event to the step it starts in
    inside: list[dict[tuple, list[dict]]] = [defaultdict(list) for _ in steps]
    for e in events:
        if e.get("cat") not in CPU_CATS or STEP.match(e.get("name", "")):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i >= 0 and e["ts"] + e["dur"] <= steps[i][3]:
            inside[i][(e.get("pid"), e.get("tid"))].append(e)
    out = {}
    for (n, on, _, _), by_thread in zip(steps, inside):
        totals: dict[str, float] = defaultdict(float)
        calls: dict[str, int] = defaultdict(int)
        for evs in by_thread.values():
            for name, (us, count) in self_stats(evs).items():
                totals[name] += us
                calls[name] += count
        out[n] = (on, dict(totals), dict(calls))
    return out


def _neighbour_deltas(steps: dict, name: str) -> list[float]:
    """Per offloaded step: its self ms for ``name`` less the mean of the plain steps next to it (the step before and
    the step after, where profiled): the host drifts over a run, so each offloaded step is read against its own
    neighbours in time."""
    order = sorted(steps)
    out = []
    for i, n in enumerate(order):
        if not steps[n][0]:
            continue
        near = [steps[m][1].get(name, 0.0) for m in order[max(i - 1, 0):i + 2] if not steps[m][0]]
        if near:
            out.append((steps[n][1].get(name, 0.0) - sum(near) / len(near)) / 1e3)
    return out


def compare(steps: dict[int, tuple[bool, dict[str, float], dict[str, int]]]) -> list[dict]:
    """Per name: mean self ms and calls per offloaded and per plain step, and the difference, split into the part its
    extra calls explain (at the plain steps' time per call) and the rest (``slower_ms``: the same calls taking longer);
    the neighbour-paired median difference and in how many offloaded steps it was positive. Largest difference first.
    """
    sides: dict[bool, list[tuple[dict[str, float], dict[str, int]]]] = {True: [], False: []}
    for on, ops, calls in steps.values():
        sides[on].append((ops, calls))
    if not sides[True] or not sides[False]:
        raise SystemExit("the trace needs offloaded and plain steps (profile at least two steps of an alternating "
                         "run)")
    names = set().union(*(ops for ops, _ in sides[True] + sides[False]))

    def mean(side: bool, name: str, k: int) -> float:
        return sum(s[k].get(name, 0) for s in sides[side]) / len(sides[side])

    rows = []
    for n in names:
        on_ms, off_ms = mean(True, n, 0) / 1e3, mean(False, n, 0) / 1e3
        on_calls, off_calls = mean(True, n, 1), mean(False, n, 1)
        per_call = off_ms / off_calls if off_calls else (on_ms / on_calls if on_calls else 0.0)
        extra = (on_calls - off_calls) * per_call
        paired = sorted(_neighbour_deltas(steps, n))
        rows.append({"name": n, "on_ms": on_ms, "off_ms": off_ms, "delta_ms": on_ms - off_ms,
                     "on_calls": on_calls, "off_calls": off_calls, "extra_calls_ms": extra,
                     "slower_ms": on_ms - off_ms - extra,
                     "paired_median_ms": paired[len(paired) // 2] if paired else None,
                     "paired_positive": f"{sum(d > 0 for d in paired)}/{len(paired)}"})
    return sorted(rows, key=lambda r: -abs(r["delta_ms"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--skip", type=int, default=1,
                   help="profiled steps to leave out first: the first runs slow under the profiler's start (session "
                        "30: 762 ms against 470-498 ms for the next three on A), biasing whichever side it is on")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    trace = load_trace(args.trace)
    ranges = step_ranges(trace)
    for i, (n, on, start, end) in enumerate(ranges):
        note = "  (left out)" if i < args.skip else ""
        print(f"step {n} {'on ' if on else 'off'} {(end - start) / 1e3:9.1f} ms{note}")
    steps = step_ops(trace, args.skip)
    rows = compare(steps)
    on = sum(1 for o, *_ in steps.values() if o)
    total = {side: sum(r[f"{side}_ms"] for r in rows) for side in ("on", "off")}
    print(f"{on} offloaded and {len(steps) - on} plain steps; self CPU ms a step, all threads: "
          f"{total['on']:.1f} offloaded, {total['off']:.1f} plain")
    extra = sum(r["extra_calls_ms"] for r in rows)
    print(f"difference {total['on'] - total['off']:+.1f} ms: {extra:+.1f} ms in extra calls (at the plain steps' time "
          f"per call), {total['on'] - total['off'] - extra:+.1f} ms in the same calls running longer")
    print(f"{'name':<60}{'on ms':>9}{'off ms':>9}{'delta':>9}{'calls +':>9}{'slower':>9}{'paired':>9}{'>0':>7}")
    for r in rows[:args.top]:
        med = r["paired_median_ms"]
        print(f"{r['name'][:59]:<60}{r['on_ms']:>9.2f}{r['off_ms']:>9.2f}{r['delta_ms']:>+9.2f}"
              f"{r['on_calls'] - r['off_calls']:>+9.0f}{r['slower_ms']:>+9.2f}"
              f"{med if med is not None else float('nan'):>+9.2f}{r['paired_positive']:>7}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"steps": {n: on for n, (on, *_) in steps.items()},
                                                   "ranges_ms": {n: (end - start) / 1e3 for n, _, start, end in ranges},
                                                   "left_out": [n for n, *_ in ranges[:args.skip]],
                                                   "total_ms": total, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
