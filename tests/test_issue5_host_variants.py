"""benchmarks/gpu/issue5_host.sh: what each variant name sets for its run (a stand-in torchrun records the
environment and arguments; nothing trains)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_TORCHRUN = """#!/usr/bin/env bash
n=$(ls "$RECORD_DIR" | wc -l)
{ env | grep '^MCORE_OFFLOAD_' | sort; echo "ARGS $*"; } > "$RECORD_DIR/run$n"
"""


def _launches(tmp_path: Path, variants: str) -> list[tuple[dict[str, str], str]]:
    """(MCORE_OFFLOAD_* environment, torchrun arguments) of every run the script launches for ``variants``."""
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text(FAKE_TORCHRUN)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCORE_OFFLOAD_")}
    # python3 is this interpreter (the script's summary imports torch)
    env.update(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}", PYTHONPATH="", RECORD_DIR=str(record),
               COSTS="0", REPS="1", ITERS="3", CONFIG="A", VARIANTS=variants)
    subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "issue5_host.sh"), str(tmp_path / "out")], cwd=ROOT,
                   env=env, capture_output=True, text=True, timeout=120)
    out = []
    for path in sorted(record.iterdir(), key=lambda p: int(p.name[3:])):
        lines = path.read_text().splitlines()
        envs = dict(line.split("=", 1) for line in lines if line.startswith("MCORE_OFFLOAD_"))
        out.append((envs, next(line for line in lines if line.startswith("ARGS "))))
    return out


def test_variant_suffixes_and_prefixes_set_their_switches(tmp_path):
    runs = _launches(tmp_path, "sw_attn alt_attn_nosplit alt_attn_nolook alt_attn alt_attn_ifl1 alt_attn_ifl12 "
                               "alt_attn_few alt_attn_f1_ifl2 alt_attn_f4")
    assert len(runs) == 9
    (sw, sw_args), (nosplit, _), (nolook, _), (plain, plain_args), (ifl1, _), (ifl12, _), (few, _) = runs[:7]
    (f1_ifl2, _), (f4, _) = runs[7:]
    assert f1_ifl2["MCORE_OFFLOAD_FLUSH_LAYERS"] == "1" and f1_ifl2["MCORE_OFFLOAD_D2H_IN_FLIGHT"] == "2"
    assert f4["MCORE_OFFLOAD_FLUSH_LAYERS"] == "4" and "MCORE_OFFLOAD_FLUSH_LAYERS" not in few
    assert ifl1["MCORE_OFFLOAD_D2H_IN_FLIGHT"] == "1" and ifl12["MCORE_OFFLOAD_D2H_IN_FLIGHT"] == "12"
    assert "MCORE_OFFLOAD_D2H_IN_FLIGHT" not in plain
    assert few["MCORE_OFFLOAD_FORWARD_END"] == "wait" and "MCORE_OFFLOAD_D2H_IN_FLIGHT" not in few
    assert "MCORE_OFFLOAD_FORWARD_END" not in plain
    # a switching run times every third step, so GPU-timed steps fall on both sides of the switch
    assert sw["MCORE_OFFLOAD_TELEMETRY_EVERY"] == "3" and "--alternate-runtime" in sw_args
    assert nosplit["MCORE_OFFLOAD_SPLIT_CHAINS"] == "0" and "MCORE_OFFLOAD_SECOND_LOOK" not in nosplit
    assert nolook["MCORE_OFFLOAD_SECOND_LOOK"] == "0" and "MCORE_OFFLOAD_SPLIT_CHAINS" not in nolook
    assert not {"MCORE_OFFLOAD_SPLIT_CHAINS", "MCORE_OFFLOAD_SECOND_LOOK", "MCORE_OFFLOAD_TELEMETRY_EVERY"} & set(plain)
    # every suffix leaves the same offload set
    assert all("--offload-modules qkv_linear core_attn attn_proj " in args for _, args in runs)
    assert "--alternate-offload" in plain_args


def test_dmaload_all_copies_at_every_layer_and_dmaload_leaves_the_last_out(tmp_path):
    runs = _launches(tmp_path, "dmaload dmaload_all")
    assert len(runs) == 2
    (_, some), (_, every) = runs
    for args in (some, every):
        assert "--dma-load-mib 48 48 " in args and "--fine-grained-activation-offloading" not in args
    assert "--dma-load-every-layer" in every and "--dma-load-every-layer" not in some


def test_experts_hooks_runs_the_expert_points_with_nothing_large_enough_to_move(tmp_path):
    runs = _launches(tmp_path, "alt_experts_hooks alt_experts")
    assert len(runs) == 2
    (_, hooks), (_, experts) = runs
    assert "--offload-modules expert_fc1 moe_act --min-offloaded-tensor-size 1000000000000" in hooks
    assert "--offload-modules expert_fc1 moe_act" in experts and "--min-offloaded-tensor-size" not in experts
    assert "--alternate-offload" in hooks and "--alternate-offload" in experts


def test_auto_oc0_and_bx_set_auto_s_host_time_model(tmp_path):
    runs = _launches(tmp_path, "alt_auto alt_auto_oc0 alt_auto_bx")
    assert len(runs) == 3
    (plain, plain_args), (oc0, oc0_args), (bx, bx_args) = runs
    assert oc0["MCORE_OFFLOAD_AUTO_OUTSIDE_CLOCK"] == "0" and "MCORE_OFFLOAD_AUTO_OUTSIDE_CLOCK" not in plain
    assert bx["MCORE_OFFLOAD_AUTO_BACKWARD_EXPOSURE"] == "1"
    assert "MCORE_OFFLOAD_AUTO_BACKWARD_EXPOSURE" not in plain and "MCORE_OFFLOAD_AUTO_BACKWARD_EXPOSURE" not in oc0
    assert "MCORE_OFFLOAD_AUTO_OUTSIDE_CLOCK" not in bx
    for args in (plain_args, oc0_args, bx_args):
        assert "--offload-modules auto " in args and "--alternate-offload" in args


def test_autotarget_asks_auto_for_the_peak_target_in_auto_gib(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTO_GIB", "13.2")
    runs = _launches(tmp_path, "alt_autotarget_bx")
    assert len(runs) == 1
    envs, args = runs[0]
    assert "--offload-modules auto:13.2 " in args and "--alternate-offload" in args
    assert envs["MCORE_OFFLOAD_AUTO_BACKWARD_EXPOSURE"] == "1"


def test_auto_hb_sets_the_host_budget_in_per_mille(tmp_path):
    runs = _launches(tmp_path, "alt_auto_hb030 alt_auto_hb008 alt_auto")
    assert len(runs) == 3
    (hb30, args30), (hb8, _), (plain, _) = runs
    # three digits read as decimal, not octal (bash's printf would read 030 as 24)
    assert hb30["MCORE_OFFLOAD_AUTO_HOST_BUDGET"] == "0.030" and hb8["MCORE_OFFLOAD_AUTO_HOST_BUDGET"] == "0.008"
    assert "MCORE_OFFLOAD_AUTO_HOST_BUDGET" not in plain
    assert "--offload-modules auto " in args30 and "--alternate-offload" in args30
