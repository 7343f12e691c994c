"""Ours' paired overhead as a share of native's, per rank, with a bootstrap 95 % interval (issue 5's "at most a
third of native's overhead" line), from the JSON of two alternating runs (``--alternate-offload``):

    python benchmarks/overhead_ratio.py OURS.json NATIVE.json [--limit 0.3333] [--json-out FILE]
    python benchmarks/overhead_ratio.py --plot OUT.png ROWS.json ...   # a picture of earlier --json-out files
    python benchmarks/overhead_ratio.py --overhead RUN.json ... [--line-pct 2]   # one variant's pooled overhead

``--overhead`` reads the given alternating runs as one variant (ours, or a floor such as ``dmaload``), pools their
pairs per rank and judges the median paired overhead on its bootstrap interval against a percent line (issue 5's
"≤ +2 %"): ``under`` where the upper end is at or under it, ``above`` where the lower end is over it, ``unresolved``
otherwise.

Window runs (``--offload-from-step S --offload-first-steps K``: plain steps, then offloaded ones, in one process;
``offload_stop.py``) are compared the same way, their overhead taken against the plain steps before offloading first
ran: no lasting state of an alternation's plain steps can bias it (session 25). Block-alternating runs
(``--alternate-block B``) give one value per offloaded block (``paired_steps.block_values``) and pool like pairs. A
side's runs must all be of one kind.

Several files per side (``--ours A.json B.json --native C.json``) pool their pairs per rank. The verdict per rank:
``met`` where the interval's upper end is at or under the limit, ``not met`` where its lower end is above it,
``unresolved`` otherwise. Each run's pairs are recomputed from its ``step_ms`` and ``alternation.on_steps`` with the
first counted step ``pretrain_gpt.py`` used (``paired_steps.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload_stop import over_pct, window_steps  # noqa: E402
from paired_steps import (  # noqa: E402
    alternation_values,
    bootstrap_median_interval,
    bootstrap_ratio,
    first_counted_step,
    overhead_ratio_interval,
)


def run_pairs(path: str) -> dict[int, list[float]]:
    """Per rank, the values one alternating run's overhead is the median of
    (:func:`paired_steps.alternation_values`)."""
    doc = json.loads(Path(path).read_text())
    block = doc["args"].get("alternate_block")  # --alternate-block: blocks of steps (paired_steps.block_values)
    first = first_counted_step(doc["args"]["warmup_steps"], doc["args"].get("alternate_period", 2), block)
    out = {}
    for row in doc["ranks"]:
        alt = row.get("alternation")
        if alt is None:
            raise ValueError(f"{path}: rank {row['rank']} has no alternation data; run with --alternate-offload")
        out[row["rank"]] = alternation_values(row["step_ms"], alt["on_steps"], first, block)
    return out


def run_windows(path: str) -> dict[int, tuple[list[float], list[float]]]:
    """Per rank, one window run's counted (offloaded, plain-before) step times (:func:`offload_stop.window_steps`)."""
    doc = json.loads(Path(path).read_text())
    out = {}
    for row in doc["ranks"]:
        stop = row.get("offload_stop")
        if stop is None or not stop.get("plain_before_steps_counted"):
            raise ValueError(f"{path}: rank {row['rank']} has no plain steps before its offloaded ones; run with "
                             "--offload-from-step S --offload-first-steps K, S past the warm-up")
        phases = window_steps(row["step_ms"], doc["args"]["warmup_steps"], stop["first_offloaded_step"],
                              stop["first_plain_step"])
        if len(phases["offloaded"]) < 2:
            raise ValueError(f"{path}: rank {row['rank']} counts under two offloaded steps; widen the window")
        out[row["rank"]] = (phases["offloaded"], phases["before"])
    return out


def window_ratio_interval(ours: list[tuple[list[float], list[float]]], native: list[tuple[list[float], list[float]]],
                          rounds: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Ours' window overhead over native's (each the mean over a side's runs of the offloaded steps' median over the
    plain-before steps' median, less 1), with a bootstrap 95 % interval in which every phase of every run is
    resampled on its own (:func:`paired_steps.bootstrap_ratio`). ``(ratio, low, high)``."""
    def side(runs: list[tuple[list[float], list[float]]]):
        return lambda pick: sum(over_pct(pick(off), pick(before)) for off, before in runs) / len(runs)

    return bootstrap_ratio(side(ours), side(native), lambda base: f"window overhead is {base:+.2f} %", rounds, seed)


def is_window_run(path: str) -> bool:
    """Whether a run's rank 0 timed an offloading window rather than alternating steps."""
    row = json.loads(Path(path).read_text())["ranks"][0]
    return row.get("alternation") is None and row.get("offload_stop") is not None


def compare_windows(ours: list[str], native: list[str], limit: float) -> list[dict]:
    o = [run_windows(p) for p in ours]
    n = [run_windows(p) for p in native]
    ranks = sorted(o[0])
    if any(sorted(r) != ranks for r in o + n):
        raise ValueError(f"the runs have different ranks: {[sorted(r) for r in o + n]}")
    rows = []
    for rank in ranks:
        ratio, lo, hi = window_ratio_interval([r[rank] for r in o], [r[rank] for r in n])
        verdict = "met" if hi <= limit else "not met" if lo > limit else "unresolved"
        rows.append({"rank": rank, "runs_ours": len(o), "runs_native": len(n),
                     "overhead_ours_pct": round(sum(over_pct(*r[rank]) for r in o) / len(o), 2),
                     "overhead_native_pct": round(sum(over_pct(*r[rank]) for r in n) / len(n), 2),
                     "ratio": round(ratio, 3), "ratio_ci95": [round(lo, 3), round(hi, 3)], "limit": limit,
                     "verdict": verdict, "kind": "window"})
    return rows


def pooled(paths: list[str]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for p in paths:
        for rank, ratios in run_pairs(p).items():
            out.setdefault(rank, []).extend(ratios)
    return out


def pooled_overhead(paths: list[str], line_pct: float) -> list[dict]:
    """Per rank, one variant's median paired overhead over all ``paths`` with its bootstrap 95 % interval, judged
    against ``line_pct`` (the module docstring's verdicts)."""
    rows = []
    for rank, values in sorted(pooled(paths).items()):
        if len(values) < 2:
            raise ValueError(f"rank {rank} has {len(values)} alternation pairs in {paths}; an interval needs two")
        lo, hi = (100 * (v - 1) for v in bootstrap_median_interval(values))
        verdict = "under" if hi <= line_pct else "above" if lo > line_pct else "unresolved"
        rows.append({"rank": rank, "runs": len(paths), "pairs": len(values),
                     "overhead_pct": round(100 * (statistics.median(values) - 1), 2),
                     "overhead_ci95_pct": [round(lo, 2), round(hi, 2)], "line_pct": line_pct, "verdict": verdict})
    return rows


def compare(ours: list[str], native: list[str], limit: float) -> list[dict]:
    o, n = pooled(ours), pooled(native)
    if sorted(o) != sorted(n):
        raise ValueError(f"the runs have different ranks: ours {sorted(o)}, native {sorted(n)}")
    rows = []
    for rank in sorted(o):
        ratio, lo, hi = overhead_ratio_interval(o[rank], n[rank])
        verdict = "met" if hi <= limit else "not met" if lo > limit else "unresolved"
        rows.append({"rank": rank, "pairs_ours": len(o[rank]), "pairs_native": len(n[rank]),
                     "ratio": round(ratio, 3), "ratio_ci95": [round(lo, 3), round(hi, 3)], "limit": limit,
                     "verdict": verdict})
    return rows


def plot(row_files: list[str], path: str, limit: float = 1 / 3) -> bool:
    """One line per (file, rank): the ratio and its interval against the limit, from ``--json-out`` files (each
    file's name, less ``.json``, labels its lines). False where matplotlib is missing."""
    import peak_memory  # here: its pyplot() loads matplotlib, wanted only for a plot

    plt = peak_memory.pyplot()
    if plt is None:
        return False
    lines = []
    for f in row_files:
        for r in json.loads(Path(f).read_text())["rows"]:
            lines.append((f"{Path(f).stem} r{r['rank']}", r["ratio"], *r["ratio_ci95"], r["verdict"]))
    colours = {"met": "#2a7a2a", "not met": "#b03030", "unresolved": "#777777"}
    fig, ax = plt.subplots(figsize=(7.0, 0.9 + 0.28 * len(lines)))
    for y, (_, ratio, lo, hi, verdict) in enumerate(reversed(lines)):
        ax.plot([lo, hi], [y, y], color=colours[verdict], linewidth=2)
        ax.plot([ratio], [y], "o", color=colours[verdict], markersize=4)
    ax.axvline(limit, color="black", linestyle="--", linewidth=0.8, label=f"limit {limit:.2f} (a third of native's)")
    ax.set_yticks(range(len(lines)), [line[0] for line in reversed(lines)], fontsize=7)
    ax.set_xlabel("ours' paired overhead / native's (median, bootstrap 95 % interval)")
    for verdict, colour in colours.items():
        ax.plot([], [], color=colour, linewidth=2, label=verdict)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="OURS.json NATIVE.json (or use --ours / --native)")
    ap.add_argument("--ours", nargs="+", default=[])
    ap.add_argument("--native", nargs="+", default=[])
    ap.add_argument("--limit", type=float, default=1 / 3)
    ap.add_argument("--json-out")
    ap.add_argument("--plot", metavar="PNG", help="draw the rows of the given --json-out files instead")
    ap.add_argument("--overhead", action="store_true",
                    help="the given runs are one variant: its pooled overhead against --line-pct")
    ap.add_argument("--line-pct", type=float, default=2.0)
    args = ap.parse_args()
    if args.overhead:
        if not args.files or args.ours or args.native or args.plot:
            ap.error("--overhead takes one variant's alternating runs as plain arguments")
        rows = pooled_overhead(args.files, args.line_pct)
        print(f"{'rank':>4}  {'runs':>4}  {'pairs':>5}  overhead  95 % interval      verdict (line +{args.line_pct} %)")
        for r in rows:
            lo, hi = r["overhead_ci95_pct"]
            print(f"{r['rank']:>4}  {r['runs']:>4}  {r['pairs']:>5}  {r['overhead_pct']:+7.2f}  "
                  f"[{lo:+.2f}, {hi:+.2f}]  {r['verdict']}")
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"runs": args.files, "rows": rows}, indent=1))
        return 0
    if args.plot:
        if not args.files or args.ours or args.native:
            ap.error("--plot takes the --json-out files of earlier comparisons")
        return 0 if plot(args.files, args.plot, args.limit) else 1
    ours, native = list(args.ours), list(args.native)
    if args.files:
        if len(args.files) != 2 or ours or native:
            ap.error("give exactly OURS.json NATIVE.json, or --ours ... --native ...")
        ours, native = [args.files[0]], [args.files[1]]
    if not ours or not native:
        ap.error("give ours' and native's runs")
    windows = [is_window_run(p) for p in ours + native]
    if any(windows) and not all(windows):
        ap.error("compare alternating runs with alternating runs and window runs with window runs")
    rows = (compare_windows if windows[0] else compare)(ours, native, args.limit)
    print(f"{'rank':>4}  {'runs' if windows[0] else 'pairs':>9}  {'ratio':>6}  95 % interval      verdict "
          f"(limit {args.limit:.3f})")
    for r in rows:
        lo, hi = r["ratio_ci95"]
        n_ours, n_native = (r["runs_ours"], r["runs_native"]) if windows[0] else (r["pairs_ours"], r["pairs_native"])
        print(f"{r['rank']:>4}  {n_ours:>4}/{n_native:<4}  {r['ratio']:>6.3f}  [{lo:.3f}, {hi:.3f}]  {r['verdict']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"ours": ours, "native": native, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
