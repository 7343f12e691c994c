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


def self_times(events: list[dict]) -> dict[str, float]:
    """Self time (µs) by name of complete events on one thread: duration less that of the events nested in it."""
    out: dict[str, float] = defaultdict(float)
    stack: list[list] = []  # [end, name, children's time, duration]
    for ev in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        start, end = ev["ts"], ev["ts"] + ev["dur"]
        while stack and stack[-1][0] <= start:
            done = stack.pop()
            out[done[1]] += done[3] - done[2]
        if stack:
            stack[-1][2] += ev["dur"]
        stack.append([end, ev["name"], 0.0, ev["dur"]])
    for done in stack:
        out[done[1]] += done[3] - done[2]
    return out


def step_ranges(trace: dict) -> list[tuple[int, bool, float, float]]:
    """The profiled steps' ranges: (step, offloaded, start µs, end µs), in step order."""
    return sorted((int(m.group(1)), m.group(2) == "on", e["ts"], e["ts"] + e["dur"])
                  for e in trace.get("traceEvents", [])
                  if e.get("ph") == "X" and "dur" in e and (m := STEP.match(e.get("name", ""))))


def step_ops(trace: dict, skip: int = 0) -> dict[int, tuple[bool, dict[str, float]]]:
    """Per profiled step, the first ``skip`` left out: (offloaded, self µs by name over every thread inside the
    step's range)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = step_ranges(trace)[skip:]
    out = {}
    for n, on, start, end in steps:
        by_thread: dict[tuple, list[dict]] = defaultdict(list)
        for e in events:
            if e.get("cat") in CPU_CATS and start <= e["ts"] and e["ts"] + e["dur"] <= end \
                    and not STEP.match(e.get("name", "")):
                by_thread[(e.get("pid"), e.get("tid"))].append(e)
        totals: dict[str, float] = defaultdict(float)
        for evs in by_thread.values():
            for name, us in self_times(evs).items():
                totals[name] += us
        out[n] = (on, dict(totals))
    return out


def compare(steps: dict[int, tuple[bool, dict[str, float]]]) -> list[dict]:
    """Per name: mean self ms per offloaded and per plain step, and the difference; largest difference first."""
    sides: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for on, ops in steps.values():
        sides[on].append(ops)
    if not sides[True] or not sides[False]:
        raise SystemExit("the trace needs offloaded and plain steps (profile at least two steps of an alternating "
                         "run)")
    names = set().union(*sides[True], *sides[False])

    def mean(side: bool, name: str) -> float:
        return sum(s.get(name, 0.0) for s in sides[side]) / len(sides[side]) / 1e3

    rows = [{"name": n, "on_ms": mean(True, n), "off_ms": mean(False, n)} for n in names]
    for r in rows:
        r["delta_ms"] = r["on_ms"] - r["off_ms"]
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
    on = sum(1 for o, _ in steps.values() if o)
    total = {side: sum(r[f"{side}_ms"] for r in rows) for side in ("on", "off")}
    print(f"{on} offloaded and {len(steps) - on} plain steps; self CPU ms a step, all threads: "
          f"{total['on']:.1f} offloaded, {total['off']:.1f} plain")
    print(f"{'name':<70}{'on ms':>10}{'off ms':>10}{'delta':>10}")
    for r in rows[:args.top]:
        print(f"{r['name'][:69]:<70}{r['on_ms']:>10.2f}{r['off_ms']:>10.2f}{r['delta_ms']:>+10.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"steps": {n: on for n, (on, _) in steps.items()},
                                                   "ranges_ms": {n: (end - start) / 1e3 for n, _, start, end in ranges},
                                                   "left_out": [n for n, *_ in ranges[:args.skip]],
                                                   "total_ms": total, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
