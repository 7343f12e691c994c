"""Draw docs/img/streams.png: the three CUDA streams of one chunk, four layers, forward then backward.

Schematic (not to scale, not a trace). Run: python docs/img/draw_streams.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

LANES = {"compute": 2.0, "D2H": 1.0, "H2D": 0.0}
COLORS = {"fwd": "#8fb8de", "bwd": "#f4a582", "d2h": "#92c5a0", "h2d": "#c2a5cf", "kept": "#dddddd"}
H = 0.6


def box(ax, lane, x0, w, text, color, hatch=None):
    y = LANES[lane] - H / 2
    ax.add_patch(plt.Rectangle((x0, y), w, H, facecolor=color, edgecolor="black", lw=0.8, hatch=hatch))
    ax.text(x0 + w / 2, LANES[lane], text, ha="center", va="center", fontsize=8)


def arrow(ax, x0, y0, x1, y1, color="black", style="-|>", ls="-"):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=10, color=color,
                                 lw=1.0, linestyle=ls, shrinkA=0, shrinkB=0))


def main() -> None:
    fig, ax = plt.subplots(figsize=(13, 3.6))
    fw, bw, gap = 1.0, 2.0, 0.6
    # Forward: layer i's groups are flushed (D2H) when layer i+1 starts; the last layer is never copied.
    for i in range(4):
        x = i * fw
        box(ax, "compute", x, fw, f"L{i + 1} fwd" if i < 3 else "L4 fwd\n(last: kept)", COLORS["fwd"])
        if i < 3:
            box(ax, "D2H", x + fw + 0.05, fw * 0.7, f"copy L{i + 1}", COLORS["d2h"])
            arrow(ax, x + fw, LANES["compute"] - H / 2, x + fw + 0.05, LANES["D2H"] + H / 2, color="#2b7a3d")
    ax.text(4 * fw + 0.05, LANES["D2H"] - 0.45, "no copy of L4: its backward comes first",
            ha="right", va="center", fontsize=7, style="italic")
    # Backward: L4, L3, L2, L1. Reload of L(i-1) is prefetched while L(i) runs its backward;
    # the compute stream waits on the H2D event before L(i-1)'s backward.
    b0 = 4 * fw + gap
    box(ax, "H2D", b0 + 0.05, 0.7, "reload L3", COLORS["h2d"])  # prefetched during L4's backward
    for k, layer in enumerate([4, 3, 2, 1]):
        x = b0 + k * bw
        box(ax, "compute", x, bw, f"L{layer} bwd", COLORS["bwd"])
        if layer - 2 >= 1:  # prefetch the layer after the next one in backward order
            box(ax, "H2D", x + bw + 0.05, 0.7, f"reload L{layer - 2}", COLORS["h2d"])
        if layer <= 3:  # compute waits on this layer's H2D event before its backward
            src = x - bw + 0.05 + 0.7 if layer < 3 else b0 + 0.05 + 0.7
            arrow(ax, src, LANES["H2D"] + H / 2, x, LANES["compute"] - H / 2, color="#762a83")
    ax.text(b0 + 0.85, 1.0, "compute waits on\nthe H2D event", color="#762a83", fontsize=7, ha="left")
    ax.axvline(4 * fw + gap / 2, color="grey", lw=0.8, ls=":")
    ax.text(2 * fw, 2.55, "forward", ha="center", fontsize=10)
    ax.text(b0 + 2 * bw, 2.55, "backward", ha="center", fontsize=10)
    ax.set_yticks(list(LANES.values()))
    ax.set_yticklabels([f"{k} stream" for k in LANES])
    ax.set_xlim(-0.2, b0 + 4 * bw + 0.4)
    ax.set_ylim(-0.55, 2.8)
    ax.set_xticks([])
    ax.set_xlabel("time (schematic, not to scale)")
    for s in ("top", "right"):
        ax.spines[s].set_visible(False)
    legend = [plt.Rectangle((0, 0), 1, 1, facecolor=COLORS[k], edgecolor="black") for k in ("fwd", "bwd", "d2h", "h2d")]
    ax.legend(legend, ["forward compute", "backward compute", "D2H copy (side stream)", "H2D reload (side stream)"],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(__file__).with_name("streams.png")
    fig.savefig(out, dpi=130)
    print(out)


if __name__ == "__main__":
    main()
