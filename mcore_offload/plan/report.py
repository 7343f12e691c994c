"""Present a :class:`~mcore_offload.plan.planner.Plan`: a fixed-width table, a JSON document, a PNG chart."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mcore_offload.config import OFFLOAD_MODULES
from mcore_offload.plan.planner import GIB, Plan, RankPlan

logger = logging.getLogger(__name__)

MIB = 2**20
SCHEMA = "mcore-offload-plan/1"


def _ranges(ranges: list[range]) -> str:
    return ",".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start) for r in ranges if len(r))


def _in_flight(rank: RankPlan) -> str:
    if len(rank.chunks) == 1:
        return str(rank.peak.in_flight)
    per_chunk = " ".join(f"c{c.chunk}:{c.in_flight}" for c in rank.chunks)
    return f"{rank.peak.in_flight} ({per_chunk})"


def _header(plan: Plan) -> list[str]:
    cfg = plan.config
    m, lay, tr, hw = cfg.model, cfg.layout, cfg.training, cfg.hardware
    arch = f"{m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads / {m.query_groups} groups"
    if m.num_experts:
        arch += f", {m.num_experts} experts top-{m.moe_router_topk} (moe ffn {m.moe_ffn}, " + (
            "grouped GEMM)" if tr.moe_grouped_gemm else "SequentialMLP)")
    else:
        arch += f", ffn {m.ffn_hidden_size}"
    recompute = tr.recompute_granularity or "none"
    if tr.recompute_granularity == "selective":
        recompute += " " + ",".join(sorted(tr.recomputed))
    elif tr.full_recompute:
        recompute += f" {tr.recompute_method or 'uniform'} {tr.recompute_num_layers or 1}"
    switches = "".join(f", {name}" for name, on in (("deterministic", tr.deterministic),
                                                     ("fused permute", tr.moe_permute_fusion and m.num_experts),
                                                     ("unfused RoPE", m.rope and not tr.rope_fusion),
                                                     (f"{m.position_embedding_type} positions", not m.rope),
                                                     ("unfused softmax", not tr.te and not tr.masked_softmax_fusion),
                                                     (f"hidden dropout {tr.hidden_dropout:g}", tr.hidden_dropout),
                                                     (f"attention dropout {tr.attention_dropout:g}",
                                                      tr.attention_dropout)) if on)
    link = hw.link
    fp8 = f" with fp8 {tr.fp8_format} ({tr.fp8_recipe})" if tr.fp8 else ""
    return [
        f"mcore-offload plan: {m.name} ({arch})",
        f"layout: TP={lay.tp} SP={'on' if lay.sp else 'off'} PP={lay.pp} VPP={lay.vpp} EP={lay.ep} ETP={lay.etp} | "
        f"seq {tr.seq_length} x mbs {tr.micro_batch_size}, {tr.num_microbatches} microbatches, {tr.dtype}{fp8}, "
        f"{tr.transformer_impl}, recompute {recompute}, min size {tr.min_offloaded_tensor_size}{switches}",
        f"schedule: {plan.schedule} | gpu {hw.name}: D2H {link.d2h_gbps:g} / H2D {link.h2d_gbps:g} / both "
        f"{link.both_gbps:g} GB/s, {hw.dense_tflops:g} TFLOP/s, {hw.memory_gib:g} GiB ({hw.source})",
    ]


def _points_table(plan: Plan) -> list[str]:
    kinds = list(plan.layers)
    lines = ["", "Offload points: MiB per layer per microbatch on one rank (after the min-size rule)",
             f"{'point':<12}" + "".join(f"{k:>10}" for k in kinds) + "  note"]
    for name in OFFLOAD_MODULES:
        cells = "".join(f"{plan.layers[k].points[name].offloaded_bytes / MIB:>10.1f}" for k in kinds)
        notes = dict.fromkeys(plan.layers[k].points[name].note for k in kinds
                              if plan.layers[k].points[name].storages or len(kinds) == 1)
        valid = all(plan.layers[k].points[name].validated for k in kinds if plan.layers[k].points[name].storages)
        mark = "" if valid else " [unvalidated]"
        lines.append(f"{name:<12}{cells}  {'; '.join(notes) or plan.layers[kinds[0]].points[name].note}{mark}")
    lines.append(f"{'saved total':<12}" + "".join(f"{plan.layers[k].total_bytes / MIB:>10.1f}" for k in kinds)
                 + "  everything one layer keeps for backward without offloading")
    lines.append(f"{'forward ms':<12}" + "".join(f"{plan.forward_seconds[k] * 1e3:>10.3f}" for k in kinds)
                 + "  one layer's forward at the GEMM rate (backward ~2x)")
    return lines


def _sets_table(plan: Plan) -> list[str]:
    lines = ["", "Offload sets: transfer against compute per layer (the worst layer kind)",
             f"{'set':<22}{'MiB/layer':>10}{'D2H ms':>9}{'H2D ms':>9}{'fwd ms':>9}{'exposed':>9}  hidden  modules"]
    for s in plan.sets:
        if not s.modules:
            continue
        kind = max(s.timing, key=lambda k: (s.timing[k].exposed_fraction, s.bytes_per_layer[k]))
        t = s.timing[kind]
        lines.append(f"{s.label:<22}{t.nbytes / MIB:>10.1f}{t.d2h_s * 1e3:>9.3f}{t.h2d_s * 1e3:>9.3f}"
                     f"{t.forward_s * 1e3:>9.3f}{s.exposed_fraction:>9.1%}  {'yes' if s.hidden else 'no':<6}  "
                     f"{' '.join(s.modules)}")
    return lines


def _ranks_table(plan: Plan) -> list[str]:
    labels = [s.label for s in plan.sets]
    widths = [max(len(label), 6) + 2 for label in labels]
    layers = [_ranges([c.layers for c in r.chunks]) for r in plan.ranks]
    flights = [_in_flight(r) for r in plan.ranks]
    lw, fw = max(map(len, layers + ["layers"])) + 2, max(map(len, flights + ["in-flight"])) + 2
    lines = ["", "Projected peak per pipeline rank, GiB (static = weights + grads + workspaces; each set column = "
                 "static + activations + logits)",
             f"{'rank':<6}{'layers':<{lw}}{'in-flight':<{fw}}{'static':>8}"
             + "".join(f"{label:>{w}}" for label, w in zip(labels, widths))]
    for r, lay, flight in zip(plan.ranks, layers, flights):
        lines.append(f"{r.rank:<6}{lay:<{lw}}{flight:<{fw}}{r.static_bytes / GIB:>8.2f}"
                     + "".join(f"{r.total_bytes(label) / GIB:>{w}.2f}" for label, w in zip(labels, widths)))
    return lines


def format_table(plan: Plan) -> str:
    """The rank-0-style report printed by ``mcore-offload plan``."""
    lines = _header(plan) + _points_table(plan) + _sets_table(plan) + _ranks_table(plan)
    rec = plan.recommendation
    modules = " ".join(rec.modules) if rec.modules else "(none: do not offload)"
    lines += ["", f"recommended offload_modules: {modules}", f"  why: {rec.reason}"]
    if rec.modules:
        freed = max(rec.freed_bytes, default=0) / GIB
        lines[-1] += f"; exposed {rec.exposed_fraction:.1%}, lowers the peak by up to {freed:.2f} GiB per rank"
    if plan.config.memory_target_gib is not None:
        lines.append(f"  memory target: {plan.config.memory_target_gib:g} GiB per rank; "
                     f"met: {'yes' if rec.meets_target else 'no'}")
    if plan.warnings:
        lines += ["", "notes:"] + [f"  - {w}" for w in plan.warnings]
    return "\n".join(lines) + "\n"


def to_json(plan: Plan) -> dict[str, Any]:
    """A JSON-ready dict (schema ``mcore-offload-plan/1``, bytes as integers)."""
    cfg = plan.config
    return {
        "schema": SCHEMA,
        "model": asdict(cfg.model),
        "layout": asdict(cfg.layout),
        "training": asdict(cfg.training),
        "hardware": asdict(cfg.hardware),
        "memory_target_gib": cfg.memory_target_gib,
        "max_exposed_fraction": cfg.max_exposed,
        "schedule": plan.schedule,
        "layer_kinds": {
            kind: {
                "saved_bytes": acts.total_bytes,
                "forward_seconds": plan.forward_seconds[kind],
                "points": {name: {"bytes": p.offloaded_bytes, "validated": p.validated, "note": p.note,
                                  "storages": [asdict(s) for s in p.storages]}
                           for name, p in acts.points.items()},
                "saved": [asdict(s) for s in acts.saved],
            } for kind, acts in plan.layers.items()
        },
        "sets": [{
            "label": s.label, "modules": list(s.modules), "bytes_per_layer": dict(s.bytes_per_layer),
            "exposed_fraction": s.exposed_fraction, "hidden": s.hidden,
            "timing": {k: {"bytes": t.nbytes, "forward_s": t.forward_s, "d2h_s": t.d2h_s, "h2d_s": t.h2d_s,
                           "both_s": t.both_s, "exposed_s": t.exposed_s} for k, t in s.timing.items()},
        } for s in plan.sets],
        "ranks": [{
            "rank": r.rank,
            "chunks": [{"chunk": c.chunk, "first_layer": c.layers.start, "num_layers": len(c.layers),
                        "kinds": dict(c.kinds), "in_flight": c.in_flight} for c in r.chunks],
            "in_flight_forwards": r.peak.in_flight,
            "offloaded_layers_at_peak": dict(r.offloaded_layers),
            "peak_instant": dict(r.peak_instants),
            "static_bytes": r.static_bytes,
            "logits_bytes": r.logits_bytes,
            "activation_peak_bytes": dict(r.activation_bytes),
            "total_peak_bytes": {label: r.total_bytes(label) for label in r.activation_bytes},
        } for r in plan.ranks],
        "recommendation": {"modules": list(plan.recommendation.modules),
                           "exposed_fraction": plan.recommendation.exposed_fraction,
                           "freed_bytes": list(plan.recommendation.freed_bytes),
                           "meets_target": plan.recommendation.meets_target,
                           "reason": plan.recommendation.reason},
        "warnings": list(plan.warnings),
    }


def write_json(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_json(plan), indent=1, default=list) + "\n")


def write_png(plan: Plan, path: str | Path) -> bool:
    """Bar chart of each rank's projected peak per offload set; ``False`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        return False
    labels = [s.label for s in plan.sets]
    ranks = [r.rank for r in plan.ranks]
    width = 0.85 / len(labels)
    fig, ax = plt.subplots(figsize=(min(18.0, max(6.0, 0.45 * len(ranks) * len(labels))), 4.5))
    for i, label in enumerate(labels):
        xs = [rank + (i - (len(labels) - 1) / 2) * width for rank in ranks]
        ax.bar(xs, [r.total_bytes(label) / GIB for r in plan.ranks], width, label=label)
    target = plan.config.memory_target_gib
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g} GiB")
    ax.set_xticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylabel("projected peak (GiB)")
    cfg = plan.config
    ax.set_title(f"{cfg.model.name}: TP{cfg.layout.tp} PP{cfg.layout.pp} VPP{cfg.layout.vpp} EP{cfg.layout.ep}, "
                 f"{cfg.hardware.name}", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
