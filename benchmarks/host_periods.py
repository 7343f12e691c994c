"""What sets a run's slow steps apart from its fast ones, from ``pretrain_gpt.py``'s per-step host clock.

Why: on the 2x H200 host the same plain run steps at 347 ms and then, for 10-40 steps at a time, at 400-520 ms, with
the issue time rising alike (session 27). If the slow steps are the ones where the hypervisor took the CPUs (steal) or
other processes kept the machine busy, comparisons can leave those steps out on both sides; if the training thread
itself used more CPU time for the same work, the machine's clock or caches are slower then and no filter helps.

For each run (rank 0 by default), the timed steps are split into the fastest and the slowest third by step time, and
the median of every per-step counter is printed for both, with its rank correlation to the step time over all timed
steps:

    python benchmarks/host_periods.py RUN.json [RUN.json ...] [--rank 0] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_json import load_row  # noqa: E402

logger = logging.getLogger("host_periods")

COUNTERS = ("issue_ms", "thread_cpu_ms", "process_cpu_ms", "steal_ms", "busy_cpus", "involuntary_switches")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation of two equally long lists (None where either does not vary)."""
    if len(x) != len(y) or len(x) < 3:
        return None
    rx, ry = _ranks(x), _ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return None if sxx == 0 or syy == 0 else round(sxy / (sxx * syy) ** 0.5, 3)


def split_by_step_time(row: dict, warmup: int) -> dict:
    """The fastest and slowest third of ``row``'s timed steps: each counter's median in both, and its correlation."""
    clock = dict(row.get("host_clock") or {})
    clock["issue_ms"] = row.get("issue_ms")
    steps = row["step_ms"]
    timed = list(range(warmup, len(steps)))
    if len(timed) < 6:
        raise ValueError(f"{len(timed)} timed steps: at least six are needed to compare thirds")
    order = sorted(timed, key=steps.__getitem__)
    third = len(order) // 3
    fast, slow = order[:third], order[-third:]
    out = {"timed_steps": len(timed),
           "step_ms": {"fast": round(statistics.median(steps[i] for i in fast), 1),
                       "slow": round(statistics.median(steps[i] for i in slow), 1)}}
    for name in COUNTERS:
        values = clock.get(name)
        if not values or len(values) != len(steps) or any(values[i] is None for i in timed):
            out[name] = None
            continue
        out[name] = {"fast": round(statistics.median(values[i] for i in fast), 2),
                     "slow": round(statistics.median(values[i] for i in slow), 2),
                     "rank_corr": spearman([steps[i] for i in timed], [values[i] for i in timed])}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = {}
    for path in args.runs:
        run_args, row = load_row(path, args.rank)
        if not row.get("host_clock"):
            raise SystemExit(f"{path} has no host_clock: it was written before pretrain_gpt.py recorded one "
                             "(session 27); run it again with the current benchmarks")
        got = result[path] = split_by_step_time(row, run_args["warmup_steps"])
        logger.info("%s (rank %d, %d timed steps): step %.1f ms fastest third, %.1f ms slowest", path, args.rank,
                    got["timed_steps"], got["step_ms"]["fast"], got["step_ms"]["slow"])
        for name in COUNTERS:
            c = got[name]
            if c is None:
                logger.info("  %-22s not recorded", name)
            else:
                logger.info("  %-22s fast %10.2f  slow %10.2f  rank corr. with step time %s", name, c["fast"],
                            c["slow"], c["rank_corr"])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
