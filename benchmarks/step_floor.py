"""The fastest steps of each phase of a run: its floor, which the host's slow periods leave alone.

Why: on the 2x H200 host a plain run steps at about 350 ms and, for 10-40 steps at a time, at 400-520 ms, because the
host's CPU runs slower then (session 28's host clock). Medians move with those periods; a phase's minimum and lower
percentiles move little (ours' plain steps between offloaded blocks sat at 355.6-357.7 ms in three calls, native's
at 344.7-350.3, on megatron-core 0.16.1, which without offloading steps about 4 ms faster than 0.15.3: session 29).
This tool prints them per phase, from ``pretrain_gpt.py``'s JSON:

- block- or step-alternating runs (``--alternate-offload``): the offloaded and the plain steps from the first
  counted step on; in a block run (``--alternate-block B``) each block's first step is left out (a switch's own cost
  lands there);
- window runs (``--offload-first-steps``): the plain steps before the window, the offloaded ones, the plain ones
  after (as ``offload_stop.window_steps`` counts them);
- any other run: every step after the warm-up.

``--by-position`` adds, for block runs, each phase's minimum by position within its blocks: an offset that fades
along a block is spill-over from the switch; a flat one is a state.

``--host K`` adds, per phase, the host side of its K fastest steps (medians of the issue time and of the main
thread's and the process's CPU time over the issue, from the per-step host clock): whether a phase's higher floor is
more host work or the same host work waiting longer. Backward runs on autograd's own thread, so the main thread's CPU
time leaves it out and the process's counts it (and any spin-wait in a CUDA synchronisation).

    python benchmarks/step_floor.py RUN.json [RUN.json ...] [--rank 0] [--by-position] [--host K] [--json-out FILE]

Percentiles: ``sorted[int(p * n)]`` (:func:`lower_percentile`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_stop import window_steps  # noqa: E402
from paired_steps import first_counted_step  # noqa: E402
from run_json import load_row  # noqa: E402


def lower_percentile(values: list[float], p: float) -> float:
    """The value at index ``int(p * n)`` of the sorted values (issue5_host.sh's summary prints its q10 so)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def floor_stats(values: list[float]) -> dict | None:
    """n, minimum, 10th and 25th percentile and median of ``values`` (None when empty)."""
    if not values:
        return None
    return {"n": len(values), "min": round(min(values), 2), "q10": round(lower_percentile(values, 0.1), 2),
            "q25": round(lower_percentile(values, 0.25), 2), "median": round(statistics.median(values), 2)}


def phase_steps(args: dict, row: dict) -> tuple[dict[str, list[int]], int | None]:
    """The step indices of each phase of one rank's row, and the block length (None: not a block run)."""
    n = len(row["step_ms"])
    warmup = args["warmup_steps"]
    alternation = row.get("alternation")
    if alternation and alternation.get("on_steps"):
        on = alternation["on_steps"]
        block = args.get("alternate_block")
        first = first_counted_step(warmup, args.get("alternate_period", 2), block)
        counted = [i for i in range(first, min(n, len(on))) if not (block and i > 0 and on[i] != on[i - 1])]
        return {"offloaded": [i for i in counted if on[i]], "plain": [i for i in counted if not on[i]]}, block
    if args.get("offload_first_steps") is not None:
        # window_steps slices what it is given: given the step indices, it returns each phase's indices
        return window_steps(list(range(n)), warmup, args.get("offload_from_step", 0), args["offload_first_steps"]), None
    return {"all": list(range(warmup, n))}, None


def by_position(row: dict, indices: list[int], block: int) -> list[float | None]:
    """The minimum step time at each position 0 … block-1 within its block (a step's position: how many steps of the
    same state precede it in its block)."""
    on = row["alternation"]["on_steps"]
    best: list[float | None] = [None] * block
    for i in indices:
        pos = 0
        while pos < i and on[i - pos - 1] == on[i]:
            pos += 1
        if pos < block:
            t = row["step_ms"][i]
            best[pos] = t if best[pos] is None else min(best[pos], t)
    return [None if b is None else round(b, 2) for b in best]


HOST_SERIES = ("issue_ms", "thread_cpu_ms", "process_cpu_ms")


def host_at_floor(row: dict, indices: list[int], fastest: int) -> dict | None:
    """Medians of the issue time and the host clock's CPU times over the ``fastest`` quickest of ``indices`` (None
    when the row has none of them: runs from before the host clock)."""
    chosen = sorted(indices, key=row["step_ms"].__getitem__)[:fastest]
    clock = row.get("host_clock") or {}
    out = {}
    for name in HOST_SERIES:
        series = row.get(name) if name == "issue_ms" else clock.get(name)
        values = [series[i] for i in chosen if series and i < len(series) and series[i] is not None]
        if values:
            out[name] = round(statistics.median(values), 2)
    return out or None


def run_floor(path: str, rank: int = 0, positions: bool = False, host: int = 0) -> dict:
    args, row = load_row(path, rank)
    phases, block = phase_steps(args, row)
    out = {"file": path, "rank": rank, "phases": {}}
    for name, indices in phases.items():
        stats = floor_stats([row["step_ms"][i] for i in indices])
        if stats is not None and positions and block:
            stats["min_by_position"] = by_position(row, indices, block)
        if stats is not None and host:
            stats["host_at_floor"] = host_at_floor(row, indices, host)
        out["phases"][name] = stats
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--by-position", action="store_true")
    p.add_argument("--host", type=int, default=0, metavar="K",
                   help="per phase, the issue and CPU times of its K fastest steps (medians)")
    p.add_argument("--json-out")
    a = p.parse_args(argv)
    if a.host < 0:
        p.error(f"--host {a.host}: give a number of fastest steps, 1 or more (0 leaves the host columns out)")
    rows = [run_floor(f, a.rank, a.by_position, a.host) for f in a.runs]
    for r in rows:
        print(f"{r['file']} (rank {r['rank']})")
        for name, s in r["phases"].items():
            if s is None:
                print(f"  {name:10s} no steps")
                continue
            line = (f"  {name:10s} n {s['n']:4d}  min {s['min']:8.1f}  q10 {s['q10']:8.1f}  q25 {s['q25']:8.1f}  "
                    f"median {s['median']:8.1f} ms")
            if "min_by_position" in s:
                line += "  min by position " + " ".join("-" if v is None else f"{v:.1f}" for v in s["min_by_position"])
            print(line)
            if a.host:
                h = s.get("host_at_floor")
                print(f"  {'':10s} fastest {a.host}: " + ("no host clock" if h is None else
                      "  ".join(f"{k} {v:.1f}" for k, v in h.items())))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
