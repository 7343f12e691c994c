"""Session 57: the planner's numbers for the fused paths Megatron-LM users run by default (TE's fused RoPE,
its fused single-kernel QKV split and RoPE, TE's fused MoE permutation) and for the local spec, written down
before any of these runs happened; then the measured runs are compared with them.

    python3 benchmarks/results/planner-fused-paths-session57/predict.py flags NAME      # pretrain_gpt.py's flags
    python3 benchmarks/results/planner-fused-paths-session57/predict.py predict         # -> predictions.json
    python3 benchmarks/results/planner-fused-paths-session57/predict.py compare DIR     # DIR/NAME.json against it

No-offload runs (``F*``): the predicted quantity is the peak of step 1. Offloaded runs (``P*``) are one of them
with an offload set: bytes per step per point, and the Δpeak (the twin's peak less its own), with the loss
checked bitwise against the twin. Each plan is built from the run's flags as tests/test_plan_validation.py
builds the benchmark matrix's (``plan_argv``, through session 56's ``plan_inputs``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "planner-census-session56"))
from predict import A8, COMMON, MIB, MOE_C, plan_inputs  # noqa: E402

# the local spec (LayerNorm, GeLU, learned absolute positions, unfused attention that keeps its s^2 scores) at 4
# layers and seq 2048, so that the probabilities (2048 x 2048 x 16 heads a layer) stay small
LOCAL = (f"--num-layers 4 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 {COMMON} "
         "--seq-length 2048 --transformer-impl local")
FUSED_RUNS = {
    # TE's fused RoPE (Megatron-LM's default): no cos and sin kept
    "F1-dense-ropefusion-det": f"{A8} {COMMON} --rope-fusion --deterministic",
    # one kernel splits the QKV output and rotates q and k; the qkv_linear point commits a (tensor, list) pair
    "F2-dense-qkvrope-det": f"{A8} {COMMON} --rope-fusion --fused-single-qkv-rope --deterministic",
    # C with TE's fused permutation: unpermute keeps no expert output even under deterministic algorithms
    "F3-moe-fused-det": f"{MOE_C} {COMMON} --rope-fusion --moe-permute-fusion --deterministic",
    # added after call 1, where F3 failed on this host (TE 2.9's Triton permute kernels and torch 2.11's Triton):
    # C with the fused RoPE alone
    "F6-moe-ropefusion-det": f"{MOE_C} {COMMON} --rope-fusion --deterministic",
    "F4-local-det": f"{LOCAL} --deterministic",
    # the local spec's attention dropout keeps a one-byte mask of the probabilities' size
    "F5-local-attndropout-det": f"{LOCAL} --attention-dropout 0.1 --deterministic",
}
OFFLOAD = "--fine-grained-activation-offloading --offload-modules"
ATTENTION = "qkv_linear core_attn attn_proj"
#: name -> (its no-offload twin, the offload set)
OFFLOADED_RUNS = {
    "P1-dense-ropefusion-attn-det": ("F1-dense-ropefusion-det", ATTENTION),
    "P2-dense-qkvrope-attn-det": ("F2-dense-qkvrope-det", ATTENTION),
    "P3-moe-fused-all5-det": ("F3-moe-fused-det", f"{ATTENTION} expert_fc1 moe_act"),
    "P6-moe-ropefusion-all5-det": ("F6-moe-ropefusion-det", f"{ATTENTION} expert_fc1 moe_act"),
    "P4-local-dense5-det": ("F4-local-det", f"attn_norm {ATTENTION} mlp_norm"),
    "P5-local-attndropout-core-det": ("F5-local-attndropout-det", "core_attn"),
}


def flags(name: str) -> str:
    if name in FUSED_RUNS:
        return FUSED_RUNS[name]
    twin, modules = OFFLOADED_RUNS[name]
    return f"{FUSED_RUNS[twin]} {OFFLOAD} {modules}"


def predict() -> dict:
    out = {}
    for name, run in FUSED_RUNS.items():
        out[name] = {"peak": plan_inputs(run, [])[0].ranks[0].total_bytes("none")}
    for name, (twin, modules) in OFFLOADED_RUNS.items():
        timeline = plan_inputs(FUSED_RUNS[twin], modules.split())[0].timelines[0]
        out[name] = {"delta_peak": timeline.delta_peak(modules.split()),
                     "offloaded": dict(timeline.offloaded_per_step(modules.split()))}
    return out


def _row(folder: Path, name: str) -> dict | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text())["ranks"][0] if path.exists() else None


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.2%}" if measured else "-"


def compare(folder: Path) -> None:
    predicted = json.loads((HERE / "predictions.json").read_text())
    print("MiB, predicted / measured (error). F: the no-offload peak of step 1. P: Δpeak against the twin, bytes "
          "per step per point, loss bitwise equal to the twin's")
    for name in FUSED_RUNS:
        row, p = _row(folder, name), predicted[name]["peak"]
        if row is None:
            print(f"{name:<32} {p / MIB:.1f} / no run")
            continue
        m = row["peak_bytes_step1"]
        print(f"{name:<32} {p / MIB:.1f} / {m / MIB:.1f} ({_error(p, m)})")
    for name, (twin, _) in OFFLOADED_RUNS.items():
        row, plain, p = _row(folder, name), _row(folder, twin), predicted[name]
        if row is None or plain is None:
            print(f"{name:<32} no run" + ("" if plain else " (nor its twin)"))
            continue
        delta = plain["peak_bytes_step1"] - row["peak_bytes_step1"]
        parts = [f"Δpeak {p['delta_peak'] / MIB:.1f} / {delta / MIB:.1f} ({_error(p['delta_peak'], delta)})"]
        offloaded = dict(p["offloaded"])
        got = {point: v["offloaded"] for point, v in row["offload"]["last_step"].items()}
        if "attn_proj" in offloaded and "core_attn" in offloaded and not got.get("attn_proj"):
            # the runtime counts the attention output, saved by both points, under core_attn
            offloaded["core_attn"] += offloaded.pop("attn_proj")
        parts += [f"{point} {b / MIB:.0f} / {got.get(point, 0) / MIB:.0f}" for point, b in offloaded.items()]
        parts += [f"{point} (not predicted) {b / MIB:.0f}" for point, b in got.items() if point not in offloaded and b]
        print(f"{name:<32} " + "; ".join(parts) + f"; loss equal {row['loss_hex'] == plain['loss_hex']}")


def write_predictions() -> None:
    out = predict()
    (HERE / "predictions.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, p in out.items():
        print(f"{name:<32} " + (f"peak {p['peak'] / MIB:.1f} MiB" if "peak" in p else
                                 f"Δpeak {p['delta_peak'] / MIB:.1f} MiB, per step "
                                 + ", ".join(f"{k} {v / MIB:.0f}" for k, v in p["offloaded"].items())))


COMMANDS = {"flags": lambda rest: print(flags(rest[0])), "predict": lambda rest: write_predictions(),
            "compare": lambda rest: compare(Path(rest[0]))}

if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in COMMANDS:
        COMMANDS[sys.argv[1]](sys.argv[2:])
    else:
        sys.exit(__doc__)
