"""Batch 3: the planner's offloaded numbers (bytes per step per point, Δpeak) for runs it has not seen, written
down before they ran (predictions3.json), and compared afterwards. Each run is one of predict.py's no-offload runs
with an offload set; its Δpeak is that run's peak (runs2/, runs3/, same host kind) less its own.

    python3 benchmarks/results/planner-census-session56/predict_offload.py flags NAME
    python3 benchmarks/results/planner-census-session56/predict_offload.py predict 3|5       # -> predictions3|5.json
    python3 benchmarks/results/planner-census-session56/predict_offload.py compare DIR 3|5   # DIR/NAME.json against it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from predict import ALL_RUNS, MIB, plan_inputs  # noqa: E402

OFFLOAD = "--fine-grained-activation-offloading --offload-modules"
#: name -> (the no-offload run it extends, its folder, the offload set)
RUNS3 = {
    "O1-gqa-attn-det": ("E1-gqa-det", "runs2", "qkv_linear core_attn attn_proj"),
    "O2-gqa-recompute-qkv-proj-det": ("E5-gqa-recompute-det", "runs3", "qkv_linear attn_proj"),
    "O3-moe-mbs2-experts-det": ("E2-moe-mbs2-det", "runs2", "expert_fc1 moe_act"),
    "O4-moe-recompute-fc1-det": ("E7-moe-act-norm-recompute-det", "runs3", "expert_fc1"),
}
#: batch 5 (predictions5.json): dropout's masks stay on the device, outside every offload point
RUNS5 = {"O5-dense-dropout-attn-det": ("E8-dense-dropout-det", "runs5", "qkv_linear core_attn attn_proj")}
BATCHES = {"3": RUNS3, "5": RUNS5}
ALL = {**RUNS3, **RUNS5}


def flags(name: str) -> str:
    base, _, modules = ALL[name]
    return f"{ALL_RUNS[base]} {OFFLOAD} {modules}"


def predicted(name: str) -> dict:
    base, _, modules = ALL[name]
    plan, args = plan_inputs(ALL_RUNS[base], modules.split())
    timeline = plan.timelines[0]
    return {"delta_peak": timeline.delta_peak(modules.split()),
            "offloaded": dict(timeline.offloaded_per_step(modules.split()))}


def measured(name: str, folder: Path) -> dict | None:
    base, base_folder, _ = ALL[name]
    path = folder / f"{name}.json"
    if not path.exists():
        return None
    row = json.loads(path.read_text())["ranks"][0]
    plain = json.loads((HERE / base_folder / f"{base}.json").read_text())["ranks"][0]
    return {"delta_peak": plain["peak_bytes_step1"] - row["peak_bytes_step1"],
            "offloaded": {p: v["offloaded"] for p, v in row["offload"]["last_step"].items()},
            "loss_equal": row["loss_hex"] == plain["loss_hex"]}


def write_predictions(batch: str) -> None:
    out = {name: predicted(name) for name in BATCHES[batch]}
    (HERE / f"predictions{batch}.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, p in out.items():
        print(f"{name:<32} Δpeak {p['delta_peak'] / MIB:8.1f} MiB, per step "
              + ", ".join(f"{k} {v / MIB:.0f}" for k, v in p["offloaded"].items()))


def print_comparison(folder: Path, batch: str) -> None:
    predictions = json.loads((HERE / f"predictions{batch}.json").read_text())
    print("MiB: predicted / measured (error); loss: bitwise equal to the no-offload run's")
    for name, p in predictions.items():
        m = measured(name, folder)
        if m is None:
            print(f"{name:<32} no run")
            continue
        parts = [f"Δpeak {p['delta_peak'] / MIB:.1f} / {m['delta_peak'] / MIB:.1f} "
                 f"({(p['delta_peak'] - m['delta_peak']) / m['delta_peak']:+.1%})"]
        offloaded, got_all = dict(p["offloaded"]), dict(m["offloaded"])
        if "attn_proj" in offloaded and "core_attn" in offloaded and not got_all.get("attn_proj"):
            # the runtime counts the attention output, saved by both points, under core_attn
            offloaded["core_attn"] += offloaded.pop("attn_proj")
        parts += [f"{point} {b / MIB:.0f} / {got_all.get(point, 0) / MIB:.0f}" for point, b in offloaded.items()]
        print(f"{name:<32} " + "; ".join(parts) + f"; loss equal {m['loss_equal']}")


COMMANDS = {"flags": lambda rest: print(flags(rest[0])), "predict": lambda rest: write_predictions(rest[0]),
            "compare": lambda rest: print_comparison(Path(rest[0]), rest[1])}

if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in COMMANDS:
        COMMANDS[sys.argv[1]](sys.argv[2:])
    else:
        sys.exit(__doc__)
