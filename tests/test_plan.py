"""``mcore-offload plan``: the estimator against the GPU measurements, the schedule formulas, the
recommendation, bad input, and the command line (CPU only, no megatron import)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mcore_offload.cli import build_parser, main
from mcore_offload.plan import (
    LayerCost,
    ModelSpec,
    ParallelLayout,
    PlanConfig,
    PlanError,
    RankDemand,
    TrainingSpec,
    build_plan,
    get_hardware,
    get_preset,
    in_flight_forwards,
    layer_activations,
    recommend,
    transfer_timing,
    warmup_forwards,
)
from mcore_offload.plan.cli import config_from_args
from mcore_offload.plan.model import parse_moe_layer_freq
from mcore_offload.plan.schedule import layer_assignment, peak_layers

MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent

# The models of benchmarks/results/issue3-*: TE spec, bf16, seq 4096, micro-batch 1, RMSNorm, SwiGLU, untied.
DENSE = ModelSpec(num_layers=16, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, swiglu=True,
                  untie_embeddings_and_output_weights=True)
MOE = ModelSpec(num_layers=8, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, swiglu=True,
                untie_embeddings_and_output_weights=True, num_experts=16, moe_router_topk=4, moe_ffn_hidden_size=1024)


def training(**kw) -> TrainingSpec:
    return TrainingSpec(**{"num_microbatches": 2, "dtype": "bf16", **kw})


def plan_for(model, layout=None, **kw):
    return build_plan(PlanConfig(model, layout or ParallelLayout(), training(**kw), get_hardware("h100")))


def drop(plan, label):
    """Per rank, how much the set lowers the projected peak (MiB)."""
    return [(r.activation_bytes["none"] - r.activation_bytes[label]) / MIB for r in plan.ranks]


def moved(plan, modules):
    """Per rank, the peak reduction of an arbitrary set (MiB), by the planner's schedule model."""
    return [b / MIB for b in plan.delta_peak(modules)]


# ---- bytes per point per layer: the H100 measurements -------------------------------------------------------

def test_point_bytes_match_the_h100_measurements():
    """benchmarks/results/issue4-h100-pp1 (bytes per step / layers that moved; tests/test_plan_validation.py
    checks every rank and set of the A-D matrix)."""
    dense = layer_activations(DENSE, ParallelLayout(), training(), moe=False)
    # LayerNormLinear keeps the norm output and its input (the layer input), 16 MiB each; in a chunk's first
    # layer the input is the embedding output or the received activation, held elsewhere.
    assert dense.points["qkv_linear"].offloaded_bytes == 32 * MIB
    assert dense.points["qkv_linear"].first_layer_bytes == 16 * MIB
    assert dense.offloaded_bytes(["qkv_linear"], first=True) == 16 * MIB
    assert dense.points["core_attn"].offloaded_bytes == 48 * MIB
    assert dense.offloaded_bytes(["core_attn", "attn_proj"]) == 64 * MIB
    assert dense.points["attn_norm"].offloaded_bytes == dense.points["mlp_norm"].offloaded_bytes == 0
    moe = layer_activations(MOE, ParallelLayout(), training(), moe=True)
    assert moe.points["moe_act"].offloaded_bytes == 64 * MIB
    assert moe.points["expert_fc1"].offloaded_bytes == 64 * MIB
    assert moe.points["mlp_norm"].offloaded_bytes == 16 * MIB  # the separate TENorm keeps its input
    assert all(moe.points[m].validated for m in ("qkv_linear", "core_attn", "mlp_norm", "expert_fc1", "moe_act"))


def test_bytes_generalise_with_tp_sp_gqa_and_dtype():
    llama = get_preset("llama3-8b")
    acts = layer_activations(llama, ParallelLayout(), training(), moe=False)
    assert acts.points["core_attn"].offloaded_bytes == 4096 * (4096 + 2 * 8 * 128) * 2  # GQA: 8 groups of 128
    tp2 = ParallelLayout(tensor_model_parallel_size=2)
    tp2_sp = ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True)
    qkv = {lay: layer_activations(DENSE, lay, training(), moe=False).points["qkv_linear"] for lay in (tp2, tp2_sp)}
    assert qkv[tp2].offloaded_bytes == 32 * MIB and qkv[tp2].first_layer_bytes == 16 * MIB
    # SP keeps only the local sequence shard of the norm output and of the layer input
    assert qkv[tp2_sp].offloaded_bytes == 16 * MIB and qkv[tp2_sp].first_layer_bytes == 8 * MIB
    assert layer_activations(DENSE, tp2, training(), moe=False).points["core_attn"].offloaded_bytes == 24 * MIB
    fp32 = layer_activations(DENSE, ParallelLayout(), training(dtype="fp32"), moe=False)
    assert fp32.points["core_attn"].offloaded_bytes == 96 * MIB
    moe_sp = layer_activations(MOE, tp2_sp, training(), moe=True)
    assert moe_sp.points["mlp_norm"].offloaded_bytes == 8 * MIB and not moe_sp.points["mlp_norm"].validated


def test_min_offloaded_tensor_size_applies_per_storage():
    default = layer_activations(DENSE, ParallelLayout(), training(), moe=False).points["core_attn"]
    assert default.offloaded_bytes == 48 * MIB  # softmax statistics (65536 elements) stay
    assert "below min_offloaded_tensor_size" in default.note
    everything = layer_activations(DENSE, ParallelLayout(), training(min_offloaded_tensor_size=0), moe=False)
    assert everything.points["core_attn"].offloaded_bytes == 48 * MIB + 4096 * 16 * 4
    qkv_elements = 4096 * 3 * 2048
    huge = layer_activations(DENSE, ParallelLayout(), training(min_offloaded_tensor_size=qkv_elements + 1),
                             moe=False)
    assert huge.points["core_attn"].offloaded_bytes == 0
    assert huge.points["qkv_linear"].offloaded_bytes == 0


# ---- projected peak reduction: the PP=1 and PP=2 x VPP=2 measurements ---------------------------------------

# benchmarks/results/issue3-h100-pp1-v2/compare.txt: H100, PP=1, 2 microbatches, the final runtime (MiB).
PP1_V2_DELTA_PEAK = {
    "dense": {("qkv_linear",): 464.0, ("core_attn",): 720.0, ("core_attn", "attn_proj"): 960.0,
              ("qkv_linear", "core_attn", "attn_proj", "attn_norm", "mlp_norm"): 1424.0},
    "moe": {("qkv_linear",): 208.0, ("core_attn",): 336.0, ("core_attn", "attn_proj"): 448.0,
            ("expert_fc1",): 448.0, ("moe_act",): 448.0, ("mlp_norm",): 112.0, ("attn_norm",): 0.0,
            ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"): 1663.0},
}


@pytest.mark.parametrize(("model", "modules"), [(k, m) for k, sets in PP1_V2_DELTA_PEAK.items() for m in sets])
def test_delta_peak_pp1_matches_measurements(model, modules):
    """Every microbatch's last layer turns around on the device: 15 (dense) or 7 (MoE) layers are off at the
    peak; the first layer's qkv_linear moves only the norm output (16 + 14 x 32 = 464 MiB)."""
    plan = plan_for(DENSE if model == "dense" else MOE)
    assert plan.ranks[0].peak.in_flight == 1
    measured = PP1_V2_DELTA_PEAK[model][modules]
    assert moved(plan, modules)[0] == pytest.approx(measured, abs=1.0)


def test_delta_peak_uses_the_planners_sets():
    dense = plan_for(DENSE)
    assert drop(dense, "qkv_linear") == [464.0] and drop(dense, "core_attn") == [720.0]
    assert drop(dense, "attention/all") == [1424.0]
    moe = plan_for(MOE)
    assert drop(moe, "mlp_norm") == [112.0] and drop(moe, "moe") == [896.0]
    assert drop(moe, "all") == [1664.0]  # measured 1663


def test_pipeline_order_and_kept_layers():
    """megatron-core's schedule per rank; a forward whose own backward comes next keeps its last layer."""
    from mcore_offload.plan.schedule import kept_forwards, pipeline_order

    def text(order):
        return " ".join(("F" if op.forward else "B") + f"{op.chunk}.{op.microbatch}" for op in order)

    assert text(pipeline_order(1, 0, 1, 2)) == "F0.0 B0.0 F0.1 B0.1"
    assert text(pipeline_order(2, 0, 2, 4)) == "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 " \
                                               "B1.2 B1.3 B0.2 B0.3"
    rank1 = pipeline_order(2, 1, 2, 8)
    assert text(rank1).startswith("F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0")
    assert kept_forwards(rank1) == {(1, mb) for mb in range(8)}  # the loss chunk, every microbatch
    assert kept_forwards(pipeline_order(2, 0, 2, 8)) == frozenset()
    assert [len(kept_forwards(pipeline_order(4, r, 1, 8))) for r in range(4)] == [0, 0, 0, 8]


def test_peak_instants_pp2_vpp2():
    """benchmarks/results/issue4-h200x2-pp2-vpp2 (D-dense): rank 0 peaks in the first backward, with that
    chunk's last layer reloaded through core attention and one group prefetched; rank 1 at the loss. Those runs
    predate the runtime's second look: their timelines are taken without it."""
    layout = ParallelLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    dense = plan_for(DENSE, layout, num_microbatches=8)
    assert moved(dense, ("core_attn",)) == [864.0, 528.0]  # 20 - 2 and 12 - 1 layers of 48 MiB
    rank0, rank1 = (t.without_second_look() for t in dense.timelines)
    attention = ("qkv_linear", "core_attn", "attn_proj")
    assert [t.delta_peak(attention) / MIB for t in (rank0, rank1)] == [1744.0, 1008.0]
    assert rank0.binding_instant(("core_attn",)).kind == "backward start"
    assert rank1.binding_instant(("core_attn",)).kind == "forward end"
    per_step = [t.offloaded_per_step(attention) for t in (rank0, rank1)]
    assert per_step[0]["qkv_linear"] == 1792 * MIB and per_step[1]["qkv_linear"] == 1536 * MIB


def test_second_look_only_on_the_first_stage_first_chunk():
    """runtime/second_look.py: rank 0's chunk-0 input (the embedding output) leaves once that forward has returned;
    inputs received from the previous stage stay, and every PP = 1 forward is kept (its own backward comes next),
    so PP = 1 plans do not change."""
    from dataclasses import replace

    from mcore_offload.plan.peak import FORWARD_END

    attention = ("qkv_linear", "core_attn", "attn_proj")
    sets = (attention, ("qkv_linear",), ("core_attn",), ("core_attn", "attn_proj"))
    for model in (DENSE, MOE):
        (flat,) = plan_for(model).timelines
        assert flat.second_look == frozenset() and flat.chunks[0].held(("qkv_linear",)) > 0
        forced = replace(flat, second_look=frozenset({0}))  # even marked, a kept forward gets no second look
        for s in sets:
            assert forced.offloaded_per_step(s) == flat.offloaded_per_step(s)
            assert forced.delta_peak(s) == flat.delta_peak(s)
    layout = ParallelLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    dense = plan_for(DENSE, layout, num_microbatches=8)
    assert [t.second_look for t in dense.timelines] == [frozenset({0}), frozenset()]
    rank0, rank1 = dense.timelines
    held = rank0.chunks[0].held(("qkv_linear",))
    assert held == 16 * MIB and rank0.chunks[0].held(("core_attn", "attn_proj")) == 0  # the 16 MiB layer input
    plain = rank0.without_second_look()
    assert plain.second_look == frozenset() and rank1.without_second_look() == rank1
    gained = rank0.offloaded_per_step(attention)["qkv_linear"] - plain.offloaded_per_step(attention)["qkv_linear"]
    assert gained == 8 * held  # every chunk-0 forward on rank 0 (none kept)
    assert [b / MIB for b in dense.delta_peak(attention)] == [1792.0, 1008.0]  # 1744 + 3 inputs in flight
    assert moved(dense, ("core_attn",)) == [864.0, 528.0]
    for inst in rank0.instants:  # a forward end holds its own input still; every other in-flight one is out
        own = inst.kind == FORWARD_END and inst.chunk == 0
        extra = rank0.offloaded_at(inst, ("qkv_linear",)) - plain.offloaded_at(inst, ("qkv_linear",))
        assert extra == (inst.in_flight[0] - own) * held
    one_f1b = plan_for(DENSE, ParallelLayout(pipeline_model_parallel_size=2), num_microbatches=1).timelines[0]
    assert one_f1b.second_look == frozenset({0}) and one_f1b.kept == (1,)  # F0 B0: kept, so nothing more moves
    assert one_f1b.offloaded_per_step(attention) == one_f1b.without_second_look().offloaded_per_step(attention)
    assert one_f1b.delta_peak(attention) == one_f1b.without_second_look().delta_peak(attention)


# ---- schedule -----------------------------------------------------------------------------------------------

def test_in_flight_1f1b_pp4():
    assert [warmup_forwards(4, r, 1, 8) for r in range(4)] == [3, 2, 1, 0]
    assert [in_flight_forwards(4, r, 1, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight_forwards(4, r, 1, 2) for r in range(4)] == [2, 2, 2, 1]  # min(p - r, m)
    assert in_flight_forwards(1, 0, 1, 8) == 1


def test_in_flight_interleaved_pp2_vpp2():
    assert [warmup_forwards(2, r, 2, 8) for r in range(2)] == [4, 2]  # (p-r-1)*2 + (v-1)*p
    assert [in_flight_forwards(2, r, 2, 8) for r in range(2)] == [5, 3]
    assert in_flight_forwards(4, 0, 2, 4) == 8  # warm-up (10) capped at m * v
    layout = ParallelLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    chunks = layer_assignment(16, layout)
    assert chunks == ((range(0, 4), range(8, 12)), (range(4, 8), range(12, 16)))
    rank0, rank1 = (peak_layers(chunks[r], 2, r, 8) for r in range(2))
    assert rank0.forward_chunks == (0, 0, 1, 1, 0) and rank0.turning_layer == 3
    assert rank1.forward_chunks == (0, 0, 1) and rank1.turning_layer == 15


def test_uneven_first_and_last_stage():
    layout = ParallelLayout(pipeline_model_parallel_size=8, decoder_first_pipeline_num_layers=5,
                            decoder_last_pipeline_num_layers=8)
    plan = build_plan(PlanConfig(get_preset("deepseek-v3"), layout, training(num_microbatches=32),
                                 get_hardware("gb200")))
    assert [len(r.chunks[0].layers) for r in plan.ranks] == [5, 8, 8, 8, 8, 8, 8, 8]
    assert plan.ranks[0].chunks[0].kinds == {"dense": 3, "moe": 2}  # the first three layers are dense


def test_local_spec_estimates_are_validated_at_tp1_only():
    """benchmarks/results/planner-fused-paths-session57 checked the local spec's bytes at TP = 1."""
    acts = layer_activations(DENSE, ParallelLayout(), training(transformer_impl="local"), moe=False)
    assert acts.points["attn_norm"].offloaded_bytes == 16 * MIB and acts.points["attn_norm"].validated
    assert acts.points["core_attn"].offloaded_bytes > 48 * MIB  # the s^2 attention probabilities
    tp2 = layer_activations(DENSE, ParallelLayout(tensor_model_parallel_size=2), training(transformer_impl="local"),
                            moe=False)
    assert not any(tp2.points[m].validated for m in ("attn_norm", "qkv_linear", "core_attn", "mlp_norm"))


# ---- transfer against compute and the recommendation ---------------------------------------------------------

def test_transfer_timing_overlap_model():
    link = get_hardware("h100").link
    hidden = transfer_timing(16 * MIB, 1e-3, link)
    assert hidden.exposed_s == 0 and hidden.d2h_s == pytest.approx(16 * MIB / 54.9e9)
    exposed = transfer_timing(110 * MIB, 1e-3, link)  # D2H ~2.1 ms against a 1 ms forward
    assert exposed.exposed_s == pytest.approx(exposed.d2h_s - 1e-3 + max(0, exposed.h2d_s - 2e-3))
    assert exposed.exposed_fraction == pytest.approx(exposed.exposed_s / 3e-3)
    assert transfer_timing(110 * MIB, 1e-3, get_hardware("gb200").link).exposed_s == 0


def test_recommend_pure_function():
    link = get_hardware("h100").link
    # 1.3 ms forward: 64 MiB (D2H 1.22 ms) hides, 80 MiB (1.53 ms) leaves 5.8% of 3.9 ms exposed.
    costs = {"dense": LayerCost({"qkv_linear": 16 * MIB, "core_attn": 48 * MIB, "attn_proj": 16 * MIB}, 1.3e-3)}
    rec = recommend(costs, link)
    assert rec.modules == ("qkv_linear", "core_attn") and rec.exposed_fraction <= 0.02
    assert recommend(costs, get_hardware("gb200").link).modules == ("qkv_linear", "core_attn", "attn_proj")
    # Just enough for the target: 10 layers at the peak, 150 MiB to free -> core_attn (480) is the least.
    need = recommend(costs, link, [RankDemand({"dense": 10}, 150 * MIB)])
    assert need.modules == ("qkv_linear",) and need.meets_target
    need = recommend(costs, link, [RankDemand({"dense": 10}, 500 * MIB)])  # 640 MiB; ties go to canonical order
    assert need.modules == ("qkv_linear", "core_attn") and need.meets_target
    exposed = recommend(costs, link, [RankDemand({"dense": 10}, 700 * MIB)])  # only "all" (800) is enough
    assert exposed.modules == ("qkv_linear", "core_attn", "attn_proj") and exposed.meets_target
    assert "exposed" in exposed.reason and exposed.exposed_fraction > 0.02
    fits = recommend(costs, link, [RankDemand({"dense": 10}, -1)])
    assert fits.modules == () and fits.meets_target
    too_much = recommend(costs, link, [RankDemand({"dense": 10}, 10_000 * MIB)])
    assert too_much.meets_target is False and "no set reaches" in too_much.reason
    only_proj = recommend({"dense": LayerCost({"attn_proj": 16 * MIB}, 1e-3)}, link)
    assert only_proj.modules == ("core_attn", "attn_proj")  # attn_proj is never recommended alone


def test_memory_target_drives_the_recommendation():
    base = plan_for(DENSE)
    peak = base.ranks[0].total_bytes("none") / 2**30
    tight = build_plan(PlanConfig(DENSE, ParallelLayout(), training(), get_hardware("gb200"), peak - 0.5))
    assert tight.recommendation.meets_target
    assert tight.ranks[0].total_bytes("recommended") <= (peak - 0.5) * 2**30
    assert tight.recommendation.modules == ("core_attn",)  # 720 MiB: the least that frees 512 MiB


# ---- bad input: one sentence, what is wrong and what to do ---------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--preset", "gpt5"], r"Unknown preset 'gpt5': choose one of llama3-8b, .*deepseek-v3"),
    (["--preset", "llama3-8b", "--offload-modules", "qkv"], r"Unknown offload module\(s\) \['qkv'\]: choose from"),
    (["--preset", "llama3-8b", "--pipeline-model-parallel-size", "5"],
     r"--num-layers \(32\) is not divisible by PP x VPP \(5\); pick"),
    (["--preset", "llama3-8b", "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "3"],
     r"not divisible by PP x --num-layers-per-virtual-pipeline-stage \(4 x 3\)"),
    (["--preset", "mixtral-8x7b", "--expert-model-parallel-size", "3"],
     r"--num-experts \(8\) is not divisible by --expert-model-parallel-size \(3\); use an EP size"),
    (["--preset", "llama3-8b", "--expert-model-parallel-size", "2"], r"needs a MoE model; add --num-experts"),
    (["--preset", "llama3-8b", "--offload-modules", "attn_proj"], r"attn_proj without core_attn.*add core_attn"),
    (["--preset", "mixtral-8x7b", "--tensor-model-parallel-size", "2"], r"add --sequence-parallel"),
    (["--preset", "llama3-8b", "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size",
      "2", "--num-microbatches", "3"], r"needs --num-microbatches \(3\) to be a multiple of"),
    (["--preset", "llama3-8b", "--gpu", "a100"], r"Unknown GPU 'a100': choose one of h100, h200, gb200"),
    (["--preset", "llama3-8b", "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
     r"mla_up_proj needs multi-latent attention"),
    (["--num-layers", "4"], r"No model given .*pass --preset NAME"),
    (["--preset", "llama3-8b", "--tensor-model-parallel-size", "16"],
     r"--num-query-groups \(8\) is not divisible by --tensor-model-parallel-size \(16\)"),
    (["--preset", "llama3-8b", "--memory-target-gib", "-3"], r"--memory-target-gib must be a positive number"),
    (["--preset", "llama3-8b", "--recompute-granularity", "full"],
     r"full needs --recompute-method \(uniform or block\) and --recompute-num-layers"),
    (["--preset", "llama3-8b", "--recompute-granularity", "full", "--recompute-method", "block",
      "--recompute-num-layers", "0"], r"--recompute-num-layers must be a positive number of layers, got 0"),
    (["--preset", "llama3-8b", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1", "--offload-modules", "core_attn"],
     r"nothing to offload when full recompute covers every layer .*recompute_method='uniform'"),
    (["--preset", "llama3-8b", "--pipeline-model-parallel-size", "4", "--recompute-granularity", "full",
      "--recompute-method", "block", "--recompute-num-layers", "8", "--offload-modules", "core_attn"],
     r"nothing to offload when full recompute covers every layer .*recompute_method='block'"),
    (["--preset", "llama3-8b", "--context-parallel-size", "2"], r"context parallelism is not modelled"),
    (["--preset", "llama3-8b", "--recompute-activations", "--recompute-granularity", "full"],
     r"--recompute-activations means --recompute-granularity selective, which contradicts"),
])
def test_bad_input_is_one_clear_sentence(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mcore-offload plan: ") and "\n" not in err and err.endswith(".")
    assert re.search(message, err), err


def test_a_whole_megatron_lm_command_line_needs_ignore_unknown_args_and_the_skipped_flags_are_listed(capsys):
    """Flags the planner does not read are refused in one sentence that names them and the way out; with
    --ignore-unknown-args they are skipped and listed. Megatron-LM's --recompute-activations, --moe-grouped-gemm and
    --context-parallel-size 1 are read."""
    megatron = ["--use-distributed-optimizer", "--lr", "1e-4", "--data-path", "/data/x"]
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--preset", "llama3-8b", *megatron])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("unrecognized arguments: --use-distributed-optimizer --lr 1e-4 --data-path /data/x; the "
                        "planner reads model, layout and training flags only: drop the others, or add "
                        "--ignore-unknown-args to plan from a whole Megatron-LM command line.")
    assert main(["plan", "--preset", "llama3-8b", "--ignore-unknown-args", *megatron, "--recompute-activations",
                 "--moe-grouped-gemm", "--context-parallel-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "skipped --use-distributed-optimizer --lr 1e-4 --data-path /data/x (not read by the planner)" in out
    assert "recompute selective core_attn" in out  # --recompute-activations, as Megatron-LM reads it
    with pytest.raises(SystemExit):  # the other commands keep argparse's own refusal
        main(["patch", "status", "--ignore-unknown-args"])


def test_moe_layer_freq_parsing():
    assert parse_moe_layer_freq("([0]*3+[1]*58)") == (0,) * 3 + (1,) * 58
    assert parse_moe_layer_freq("2") == 2
    with pytest.raises(PlanError, match="list expression"):
        parse_moe_layer_freq("__import__('os').system('true')")


def test_preset_values_are_overridden_by_flags(capsys):
    assert main(["plan", "--preset", "llama3-8b", "--num-layers", "16", "--json", "/dev/null"]) == 0
    assert "llama3-8b (16 layers" in capsys.readouterr().out


# ---- command line ---------------------------------------------------------------------------------------------

ACCEPTANCE = ["plan", "--preset", "qwen3-30b-a3b", "--pipeline-model-parallel-size", "4",
              "--expert-model-parallel-size", "8"]


def rank_rows(out: str) -> list[str]:
    table = out.split("Projected peak per pipeline rank")[1].split("\n\n")[0].splitlines()[2:]
    return [line for line in table if line.strip()]


def test_acceptance_command_is_fast_and_prints_one_row_per_rank():
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mcore_offload", *ACCEPTANCE], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 10
    rows = rank_rows(proc.stdout)
    assert [int(row.split()[0]) for row in rows] == [0, 1, 2, 3]
    assert "recommended offload_modules:" in proc.stdout


def test_plan_path_imports_neither_megatron_nor_torch_distributed():
    code = (f"import sys; from mcore_offload.cli import main; main({ACCEPTANCE!r}); "
            "bad = [m for m in sys.modules if m.startswith(('megatron', 'torch'))]; assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_json_output_schema(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main([*ACCEPTANCE, "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["schema"] == "mcore-offload-plan/1"
    assert {"model", "layout", "training", "hardware", "schedule", "layer_kinds", "sets", "ranks",
            "recommendation", "warnings"} <= doc.keys()
    assert set(doc["layer_kinds"]["moe"]["points"]) == {"attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                                        "mlp_norm", "expert_fc1", "moe_act"}
    labels = [s["label"] for s in doc["sets"]]
    assert labels[0] == "none" and labels[-1] == "recommended"
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    assert [r["in_flight_forwards"] for r in doc["ranks"]] == [4, 3, 2, 1]
    for rank in doc["ranks"]:
        assert set(rank["total_peak_bytes"]) == set(labels)
        for label in labels:
            assert rank["total_peak_bytes"][label] == rank["static_bytes"] + rank["activation_peak_bytes"][label]
            assert isinstance(rank["total_peak_bytes"][label], int)
    assert doc["recommendation"]["modules"] == doc["sets"][-1]["modules"]


def test_png_output_and_missing_matplotlib(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plan.png"
    assert main([*ACCEPTANCE, "--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    capsys.readouterr()
    assert main([*ACCEPTANCE, "--png", str(tmp_path / "again.png")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("mcore-offload plan: matplotlib is not installed, so no PNG was written; install it with "
                   "'pip install matplotlib'.")


def test_patch_subcommands_still_parse():
    for action in ("apply", "check", "revert", "status"):
        assert build_parser().parse_args(["patch", action]).action == action


def test_dropout_masks_follow_megatron_lm_defaults():
    """A hidden dropout keeps a one-byte mask at each of the layer's two residual adds, outside every offload point;
    the CLI takes Megatron-LM's 0.1 without a preset and 0 with one; TE's attention keeps no mask (the local
    spec's: tests/test_plan_local_spec.py)."""
    plain = layer_activations(DENSE, ParallelLayout(), training(dtype="bf16"), moe=False)
    dropped = layer_activations(DENSE, ParallelLayout(), training(dtype="bf16", hidden_dropout=0.1,
                                                                  attention_dropout=0.1), moe=False)
    assert dropped.total_bytes - plain.total_bytes == 2 * 4096 * 2048  # two bool masks of T h
    assert dropped.points == plain.points  # no offload point moves them
    # the whole model at PP = 1 (one microbatch in flight at the forward end): the layers' masks and the embedding's
    t_h = 4096 * 2048
    gained = plan_for(DENSE, hidden_dropout=0.1).ranks[0].total_bytes("none") - \
        plan_for(DENSE).ranks[0].total_bytes("none")
    assert gained == 16 * 2 * t_h + t_h
    model = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16", "--ffn-hidden-size", "8192"]
    config, _ = config_from_args(build_parser().parse_args(["plan", *model]))
    assert (config.training.hidden_dropout, config.training.attention_dropout) == (0.1, 0.1)
    config, _ = config_from_args(build_parser().parse_args(["plan", "--preset", "llama3-8b"]))
    assert (config.training.hidden_dropout, config.training.attention_dropout) == (0.0, 0.0)
    config, _ = config_from_args(build_parser().parse_args(["plan", *model, "--hidden-dropout", "0"]))
    assert config.training.hidden_dropout == 0.0


def test_a_dropout_outside_0_1_is_refused(capsys):
    rc = main(["plan", "--preset", "llama3-8b", "--hidden-dropout", "1.5"])
    assert rc == 2
    assert "a dropout probability must lie in [0, 1), got 1.5" in capsys.readouterr().err


def test_moe_plans_note_the_routing_spread_measured_at_ep_2(capsys):
    for ep, noted in ((1, False), (2, True)):
        assert main(["plan", "--preset", "mixtral-8x7b", "--expert-model-parallel-size", str(ep),
                     "--json", "/dev/null"]) == 0
        out = capsys.readouterr().out
        assert "MoE bytes assume balanced routing" in out
        assert ("ranks moved 7.5 % more and less than this" in out) == noted
