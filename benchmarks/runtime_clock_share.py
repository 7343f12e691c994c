"""The runtime's own host-time clock as a share of the plain step, from alternating runs' JSON (ours).

Why: in a launch-bound step the host's speed sets both the runtime's clock (``runtime_cpu_ms``, the host time inside
mcore-offload's hooks) and the step time, and the GPU host's speed drifts between calls by as much as a runtime change
saves. In session 47 the raw clock read 25.1-32.0 ms a step over five calls of the same code while the plain steps'
median moved from 426 to 543 ms; divided by the plain step, the five calls agreed within 0.05 % of a step, and
sessions 45-47 (three runtimes) separated. This divides each offloaded step's clock by the mean of its two plain
neighbours (the pairing of ``paired_steps.paired_ratios``, counted from the same first step as ``overhead_ratio.py``)
and reports the median share per run and rank, and the mean over the given runs.

    python benchmarks/runtime_clock_share.py RUN.json [RUN.json ...] [--rank 0] [--json-out FILE]

Runs with ``--alternate-offload`` and the default period of 2 only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired_steps import first_counted_step, paired_ratios  # noqa: E402


def clock_shares(step_ms: list[float], on_steps: list[bool], runtime_ms: list[float | None], first: int) -> list[float]:
    """Per offloaded step ``i`` past ``first`` with plain steps on both sides: its clock over the mean of those two.

    ``runtime_ms`` holds the offloaded steps' clocks in order (the summary records offloading steps only)."""
    clock: list[float | None] = [None] * len(step_ms)
    offloaded = [i for i, on in enumerate(on_steps) if on]
    for i, ms in zip(offloaded, runtime_ms):
        clock[i] = ms
    return paired_ratios(step_ms, on_steps, first, over=clock)


def run_share(path: str, rank: int) -> dict:
    doc = json.loads(Path(path).read_text())
    args = doc["args"]
    if not args.get("alternate_offload") or args.get("alternate_period", 2) != 2 or args.get("alternate_block"):
        raise SystemExit(f"{path}: not an alternating run with period 2 (--alternate-offload); the share needs one "
                         "plain step on each side of every offloaded step")
    row = next((r for r in doc["ranks"] if r["rank"] == rank), None)
    if row is None or "offload" not in row:
        raise SystemExit(f"{path}: no rank {rank} with our runtime's figures (is this a native or baseline run?)")
    first = first_counted_step(args["warmup_steps"], 2)
    shares = clock_shares(row["step_ms"], row["alternation"]["on_steps"],
                          row["offload"]["per_step"]["runtime_cpu_ms"], first)
    if not shares:
        raise SystemExit(f"{path}: rank {rank} has no offloaded step with plain neighbours and a clock")
    return {"run": path, "rank": rank, "steps": len(shares), "share_pct": 100 * statistics.median(shares),
            "clock_ms": row.get("runtime_cpu_ms"), "plain_ms": row["alternation"]["step_ms_off_median"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="alternating runs' JSON (ours)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    rows = [run_share(path, args.rank) for path in args.runs]
    print(f"{'clock % of plain step':>22}  {'steps':>5}  {'clock ms':>8}  {'plain ms':>8}  run (rank {args.rank})")
    for r in rows:
        print(f"{r['share_pct']:>22.2f}  {r['steps']:>5}  {r['clock_ms']:>8.1f}  {r['plain_ms']:>8.1f}  {r['run']}")
    mean = statistics.fmean(r["share_pct"] for r in rows)
    spread = (min(r["share_pct"] for r in rows), max(r["share_pct"] for r in rows))
    print(f"mean {mean:.2f} % over {len(rows)} runs (range {spread[0]:.2f} to {spread[1]:.2f})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rank": args.rank, "mean_share_pct": mean, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
