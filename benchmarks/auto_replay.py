"""Replay ``auto``'s choice offline from a benchmark JSON (each rank's ``auto_record``, runtime/auto_record.py).

For every rank that planned with ``auto``: the recorded plan, the same choice replayed here (it must match: the
choice is deterministic), what offloading every unit would take off the peak (the full set), and the plan the same
rule picks under other host-time budgets, as a share of the full set. This is how to read issue 5's "at least 90 %
of the full set's Δpeak at ≤ +2 %" against the host-time model a run measured, without device time.

    python benchmarks/auto_replay.py runs/G/alt_auto-none-1.json[.gz] [...] [--budgets 0.5 1 2 4 8 inf] [--json-out F]
        [--plot PNG --labels A B ...]   # share of the full set against modelled host time, one line per rank
        [--want 0.5 0.9]                # the MCORE_OFFLOAD_AUTO_HOST_BUDGET that buys each share, per rank

A budget multiplier scales the plan's host-time budget (HOST_BUDGET of the plain step, auto_choice.py); with ``inf``
no unit is turned away for its host time (the link alone limits the plan).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mcore_offload.runtime.auto_choice import HOST_BUDGET, choose  # noqa: E402
from mcore_offload.runtime.auto_record import from_record  # noqa: E402

GiB = 2**30


def full_set_saving(profiles: dict, trace: Any) -> int:
    """What offloading every unit the probe offloaded would take off the plain step's peak."""
    if trace is not None:
        return trace.saving({(vp, layer, unit) for vp, p in profiles.items() for layer, unit in p.unit_bytes})
    return sum(p.saving(layer, unit, n) for p in profiles.values() for (layer, unit), n in p.unit_bytes.items())


def replay(rec: dict[str, Any], budgets: list[float]) -> dict[str, Any]:
    """The recorded plan, its replay, the full set and the plan per budget multiplier, for one rank's record."""
    profiles, host, link, need, trace = from_record(rec)
    again = choose(profiles, link, need, host, trace=trace)
    full = full_set_saving(profiles, trace)
    plain_ms = _plain_ms(host)
    rows = []
    for m in budgets:
        # an infinite budget still prices each plan with the measured model, and never turns a unit away
        h = None if host is None else dataclasses.replace(host, budget_ms=host.budget_ms * m)
        plan = choose(profiles, link, need, h, trace=trace)
        host_ms = plan.host_ms
        rows.append({"budget_x": m, "saving_bytes": plan.expected_saving_bytes,
                     "share_of_full": plan.expected_saving_bytes / full if full else None,
                     "host_ms": host_ms, "host_pct_of_step": 100 * host_ms / plain_ms if plain_ms else None,
                     "points": sum(len(v) for v in plan.points.values()), "describe": plan.describe()})
    same_points = _points((vp, layer, pts) for (vp, layer), pts in again.points.items()) == _points(
        rec["plan"]["points"])
    return {"recorded": rec["plan"]["describe"], "replayed": again.describe(),
            "replay_matches": same_points and again.expected_saving_bytes == rec["plan"]["expected_saving_bytes"],
            "full_set_saving_bytes": full, "plain_step_ms": plain_ms,
            "budget_ms": None if host is None else host.budget_ms, "budgets": rows}


#: The budget multipliers :func:`budgets_for` tries: 1/8x to 64x the recorded budget, each 10 % above the last.
SEARCH_MULTIPLIERS = tuple(0.125 * 1.1**k for k in range(int(math.log(512) / math.log(1.1)) + 2))


def budgets_for(rec: dict[str, Any], wants: list[float]) -> list[dict[str, Any] | None]:
    """For each share in ``wants``: the smallest host-time budget (as ``MCORE_OFFLOAD_AUTO_HOST_BUDGET``, a share of
    the plain step) whose plan takes at least that share of the full set's saving, from one rank's record; None
    where no share under 1 does."""
    profiles, host, link, need, trace = from_record(rec)
    full = full_set_saving(profiles, trace)
    found: list[dict[str, Any] | None] = [None] * len(wants)
    if host is None or not full:
        return found
    plain_ms = _plain_ms(host)
    for m in SEARCH_MULTIPLIERS:
        share = host.budget_share * m
        if share >= 1.0 or all(f is not None for f in found):
            break
        plan = choose(profiles, link, need, dataclasses.replace(host, budget_ms=host.budget_ms * m), trace=trace)
        for i, want in enumerate(wants):
            if found[i] is None and plan.expected_saving_bytes >= want * full:
                found[i] = {"want": want, "host_budget": share, "budget_x": m,
                            "share_of_full": plan.expected_saving_bytes / full,
                            "host_pct_of_step": 100 * plan.host_ms / plain_ms}
    return found


def _plain_ms(host: Any) -> float | None:
    """The plain step the record's budget was a share of."""
    return host.budget_ms / host.budget_share if host is not None and host.budget_share else None


def _points(points: Any) -> list:
    """(chunk, layer, points) triples in one comparable form (a frozenset's order is not its content's)."""
    return sorted(((vp, layer, sorted(pts)) for vp, layer, pts in points), key=str)


def _load(path: str) -> dict[str, Any]:
    """A benchmark JSON, gzipped or not (the records' traces make a pipeline rank's JSON about 1 MB)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="benchmark JSON files (pretrain_gpt.py's, with 'ranks')")
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.5, 1.0, 2.0, 4.0, 8.0, math.inf])
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--plot", default=None, help="draw each rank's share of the full set against its host time")
    ap.add_argument("--labels", nargs="+", default=None, help="one name per file for the plot's legend")
    ap.add_argument("--want", nargs="+", type=float, default=[],
                    help="shares of the full set's saving (0.5 0.9): the host budget each needs, per rank")
    args = ap.parse_args(argv)
    out = []
    for f in args.files:
        for r in _load(f)["ranks"]:
            rec = r.get("auto_record")
            if not rec:
                continue
            res = replay(rec, args.budgets)
            label = args.labels[args.files.index(f)] if args.labels else Path(f).parent.name
            res.update(file=f, rank=r["rank"], label=label)
            out.append(res)
            same = "matches" if res["replay_matches"] else "DIFFERS"
            print(f"{f} rank {r['rank']}: full set {res['full_set_saving_bytes'] / GiB:.2f} GiB off the plain peak; "
                  f"plain step {res['plain_step_ms'] or 0:.1f} ms; replay {same}")
            print(f"  {'budget':>7} {'saving GiB':>10} {'of full':>8} {'host ms':>8} {'% step':>7} {'points':>6}")
            for row in res["budgets"]:
                share = "-" if row["share_of_full"] is None else f"{100 * row['share_of_full']:.0f} %"
                pct = "-" if row["host_pct_of_step"] is None else f"{row['host_pct_of_step']:.1f}"
                print(f"  {row['budget_x']:>6}x {row['saving_bytes'] / GiB:>10.2f} {share:>8} {row['host_ms']:>8.1f} "
                      f"{pct:>7} {row['points']:>6}")
            found = budgets_for(rec, args.want)
            res["want"] = [f or {"want": w, "host_budget": None} for w, f in zip(args.want, found)]
            for w in res["want"]:
                if w["host_budget"] is None:
                    why = ("the record has no host-time figures (a CPU run)" if rec.get("host") is None else
                           "no host budget under the whole step buys it")
                    print(f"  for {100 * w['want']:.0f} % of the full set: {why}")
                else:
                    print(f"  for {100 * w['want']:.0f} % of the full set: MCORE_OFFLOAD_AUTO_HOST_BUDGET="
                          f"{w['host_budget']:.3f} ({w['budget_x']:.2f}x; {100 * w['share_of_full']:.0f} % at "
                          f"{w['host_pct_of_step']:.1f} % of the step modelled)")
    if not out:
        print("no rank with an auto_record in these files: run with --offload-modules auto (session 70 on)")
        return 1
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    if args.plot:
        plot(out, args.plot)
    return 0


def plot(results: list[dict[str, Any]], png: str) -> None:
    """Share of the full set's saving against the plan's modelled host time (% of the plain step), one line per rank,
    with the host budget (HOST_BUDGET) and the +2 % line marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for res in results:
        pts = sorted((row["host_pct_of_step"], 100 * row["share_of_full"]) for row in res["budgets"]
                     if row["host_pct_of_step"] is not None and row["share_of_full"] is not None)
        if pts:
            name = res["label"] + (f" rank {res['rank']}" if any(o["label"] == res["label"] and o is not res
                                                                 for o in results) else "")
            ax.plot([0.0] + [p[0] for p in pts], [0.0] + [p[1] for p in pts], marker="o", ms=3, label=name)
    ax.axvline(100 * HOST_BUDGET, color="grey", ls=":", lw=1, label=f"host budget ({100 * HOST_BUDGET:.1f} %)")
    ax.axvline(2.0, color="black", ls="--", lw=1, label="+2 % line")
    ax.axhline(90.0, color="red", ls=":", lw=1, label="90 % of the full set")
    ax.set_xlabel("modelled host time of the plan, % of the plain step")
    ax.set_ylabel("share of the full set's peak saving, %")
    ax.set_xlim(left=0)
    ax.set_ylim(0, 105)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("auto's choice replayed at scaled host budgets", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
