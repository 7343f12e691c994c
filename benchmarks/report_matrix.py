"""Merge several ``peak_memory.py`` result folders into one summary table and two figures for the docs.

    python benchmarks/report_matrix.py benchmarks/results/issue4-h100-pp1/{A,B,C} \\
        benchmarks/results/issue4-h200x2-pp2-vpp2/{D-dense,D-moe} --out docs/img/issue4

Writes ``<out>.md`` (one line per configuration, offload set and implementation: Δpeak, R and step-time
overhead per rank, loss equality), ``<out>_peak.png`` (per-rank peak memory, every configuration) and
``<out>_overhead.png`` (step-time overhead, ours against native).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peak_memory  # noqa: E402

logger = logging.getLogger("report_matrix")
SHORT = {"qkv_linear core_attn attn_proj": "attn", "expert_fc1 moe_act": "experts",
         "qkv_linear core_attn attn_proj expert_fc1 moe_act": "attn+experts"}


def load(folders: list[str]) -> list[dict]:
    rows = []
    for folder in folders:
        rows += json.loads((Path(folder) / "results.json").read_text())["rows"]
    return rows


def _per_rank(rows: list[dict], key: str, fmt: str) -> str:
    return " / ".join("-" if r[key] is None else fmt.format(r[key]) for r in sorted(rows, key=lambda r: r["rank"]))


def summary(rows: list[dict]) -> str:
    """One line per (config, impl, set); values per rank separated by '/'."""
    mib = 2**20
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("failed") or r["impl"] == "baseline":
            continue
        groups.setdefault((r["config"], " ".join(r["offload_modules"]), r["impl"]), []).append(r)
    lines = ["| config | offload_modules | impl | Δpeak MiB (per rank) | R (per rank) | overhead % (per rank) "
             "| loss bitwise equal |", "|---|---|---|---|---|---|---|"]
    for (config, modules, impl), rs in groups.items():
        delta = " / ".join(f"{r['delta_peak_bytes'] / mib:.0f}" for r in sorted(rs, key=lambda r: r["rank"]))
        r_src = " (native's own count)" if impl == "native" else ""
        lines.append(f"| {config} | {modules} | {impl} | {delta} | {_per_rank(rs, 'R', '{:.2f}')}{r_src} "
                     f"| {_per_rank(rs, 'overhead_pct', '{:+.1f}')} | {all(r['loss_equal'] for r in rs)} |")
    return "\n".join(lines) + "\n"


def overhead_plot(rows: list[dict], path: Path) -> bool:
    plt = peak_memory.pyplot()
    if plt is None:
        return False
    cases: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("failed") or r["impl"] == "baseline" or r["overhead_pct"] is None:
            continue
        name = f"{r['config']}\n{SHORT.get(' '.join(r['offload_modules']), '+'.join(r['offload_modules']))}"
        cur = cases.setdefault(name, {})
        cur[r["impl"]] = max(cur.get(r["impl"], float("-inf")), r["overhead_pct"])  # worst rank
    names = list(cases)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names)), 4.0))
    for i, impl in enumerate(("ours", "native")):
        xs = [k + (i - 0.5) * 0.38 for k in range(len(names))]
        ax.bar(xs, [cases[n].get(impl, 0.0) for n in names], 0.38, label=impl,
               color={"ours": "#1f5fa0", "native": "#c46a12"}[impl], edgecolor="black", linewidth=0.4)
    ax.axhline(0, color="black", linewidth=0.6)
    ax.axhline(2, color="#2a2", linewidth=0.8, linestyle="--", label="+2 % (issue 5's target)")
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("step-time overhead vs own baseline (%)\n(worst rank)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", nargs="+", help="peak_memory.py --out folders")
    p.add_argument("--out", required=True, help="output prefix")
    args = p.parse_args(argv)
    rows = load(args.folders)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = summary(rows)
    Path(f"{out}.md").write_text(text)
    peak_memory.plot(rows, Path(f"{out}_peak.png"))
    overhead_plot(rows, Path(f"{out}_overhead.png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
