"""``mcore-offload plan``'s whole no-offload peak against GPU runs: the benchmark matrix's (A-D), the allocator
census of benchmarks/results/planner-census-session56 (what a step holds, by call path), and that folder's runs
whose peaks were predicted before they ran. Bytes per point and peak reductions are tests/test_plan.py's and
tests/test_plan_validation.py's."""

from __future__ import annotations

import json

import pytest
from test_plan import DENSE, MIB, MOE, ROOT, plan_for

from mcore_offload.plan import ModelSpec, ParallelLayout
from mcore_offload.plan.planner import CUBLAS_WORKSPACE_BYTES, workspace_bytes


def test_baseline_peak_against_measurements():
    """The no-offload projection (weights + grads + workspaces + activations, + logits and the final norm's tensors
    or the first backward's working set) against measured peaks (benchmarks/results/issue4-*, whose runs used
    deterministic algorithms and unfused RoPE): every rank within 2 % (D's last stage the worst, 1.4 % and
    1.95 % low); PP = 1 within 0.1 %. Before session 56 MoE ran 10-15 % low (the expert outputs that unpermute's
    index_add_ keeps, 64 MiB a layer here) and dense 2-4 % (workspaces, RoPE's cos and sin, the final norm)."""
    layout = ParallelLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    wide = ModelSpec(num_layers=8, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=14336, swiglu=True,
                     untie_embeddings_and_output_weights=True)  # config B
    run = {"deterministic": True, "rope_fusion": False}
    cases = [(plan_for(DENSE, num_microbatches=4, **run), [10667.1], 0.001),
             (plan_for(wide, num_microbatches=4, **run), [14109.1], 0.001),
             (plan_for(MOE, num_microbatches=4, **run), [7953.8], 0.001),
             (plan_for(DENSE, layout, num_microbatches=8, **run), [9317.9, 7169.5], 0.015),
             (plan_for(MOE, layout, num_microbatches=8, **run), [6243.7, 5294.8], 0.02)]
    for plan, measured, tolerance in cases:
        for rank, peak in zip(plan.ranks, measured):
            assert abs(rank.total_bytes("none") / MIB - peak) / peak < tolerance
    # without deterministic algorithms megatron-core's unpermute keeps no expert output: 64 MiB a layer less
    plain = plan_for(MOE, num_microbatches=4, rope_fusion=False)
    assert (cases[2][0].ranks[0].total_bytes("none") - plain.ranks[0].total_bytes("none")) / MIB == 8 * 64
    assert plan_for(MOE, num_microbatches=4, moe_permute_fusion=True, **run).ranks[0].total_bytes("none") == \
        plain.ranks[0].total_bytes("none")  # TE's fused unpermute keeps none either


CENSUS = ROOT / "benchmarks" / "results" / "planner-census-session56" / "runs"


@pytest.mark.parametrize("run, model", [("A-det", "dense"), ("C-det", "moe"), ("C-allgather-det", "moe")])
def test_static_part_against_the_allocator_census(run, model):
    """What the allocator held at the start of step 1 once zero_grad had run (the census of
    benchmarks/results/planner-census-session56, 1 x H200) is the planner's static part less the grads (the
    backward allocates them): weights, cuBLAS workspaces, RoPE's frequencies, within 0.3 %; and the run's peak is
    the projection's within 0.1 % (C: alltoall and allgather dispatchers alike)."""
    row = json.loads((CENSUS / f"{run}.json").read_text())["ranks"][0]
    plan = plan_for(DENSE if model == "dense" else MOE, num_microbatches=4, deterministic=True, rope_fusion=False)
    rank = plan.ranks[0]
    workspace = workspace_bytes(plan.config, model == "moe")
    grads = (rank.static_bytes - workspace) // 2
    census = row["peak_trace"]["census"]["allocated_bytes"]
    assert abs(rank.static_bytes - grads - census) / census < 0.003
    assert abs(rank.total_bytes("none") - row["peak_bytes_step1"]) / row["peak_bytes_step1"] < 0.001
    # the workspaces the census names: TE's (get_workspace) and, with grouped-GEMM experts, its multi-stream ones
    sites = row["peak_trace"]["census"]["by_site"]
    named = sum(s["bytes"] for s in sites if "cublas_workspace" in s["where"] or "get_workspace" in s["where"])
    assert abs(named - (5 if model == "moe" else 1) * CUBLAS_WORKSPACE_BYTES) < MIB  # TE pads each by 1 KiB


PREDICTED = ROOT / "benchmarks" / "results" / "planner-census-session56"


@pytest.mark.parametrize("batch, run", [
    ("runs2", "C-nondet"), ("runs2", "E1-gqa-det"), ("runs2", "E2-moe-mbs2-det"), ("runs2", "E3-moe-mbs2-nondet"),
    ("runs2", "E4-dense-recompute-det"), ("runs3", "E5-gqa-recompute-det"), ("runs3", "E6-dense-mlp-recompute-det"),
    ("runs3", "E7-moe-act-norm-recompute-det"), ("runs5", "E8-dense-dropout-det"), ("runs5", "E9-dense-dropouts-det")])
def test_no_offload_peak_of_runs_predicted_before_they_ran(batch, run):
    """benchmarks/results/planner-census-session56/predict.py's runs (1 x H200): GQA, MoE at micro-batch 2 with and
    without deterministic algorithms, selective recompute of core_attn, mlp, moe_act + layernorm, hidden and
    attention dropout. Their peaks were predicted and committed before each batch ran; all but E4, E8 and E9 were
    met within 0.1 % as predicted. E4 missed by -4.1 % (the core-attention checkpoint's inputs), E8 and E9 by
    -0.18 % (the embedding's dropout mask); both are met since the fixes they prompted (batch 2 then predicted
    E5-E7 within 0.1 %). The plan is built from the run's own flags, as the validation matrix's are."""
    import test_plan_validation as validation

    row = json.loads((PREDICTED / batch / f"{run}.json").read_text())
    plan = validation._plan(tuple(validation.plan_argv({**row["args"], "offload_modules": []})))
    measured = row["ranks"][0]["peak_bytes_step1"]
    assert abs(plan.ranks[0].total_bytes("none") - measured) / measured < 0.001


FUSED = ROOT / "benchmarks" / "results" / "planner-fused-paths-session57"


def _run(path: str) -> tuple[dict, dict]:
    doc = json.loads((FUSED / f"{path}.json").read_text())
    return doc["args"], doc["ranks"][0]


def _plan_of(args: dict):
    import test_plan_validation as validation

    return validation._plan(tuple(validation.plan_argv(args)))


@pytest.mark.parametrize("path", ["call1/F1-dense-ropefusion-det", "call1/F2-dense-qkvrope-det",
                                  "call3/F6-moe-ropefusion-det"])
def test_fused_rope_peaks_predicted_before_they_ran(path):
    """Session 57 (1 x H200): Megatron-LM's default fused RoPE, and megatron-core's single-kernel QKV split and
    RoPE, on A's model at 8 layers and on C; predicted (predictions.json, committed before the runs) within 0.1 %:
    no cos and sin kept, and the fused QKV path keeps what the split one does. C with TE's fused permutation too
    (F3) did not run: TE 2.9's Triton permute kernels fail under the host's torch 2.11 Triton."""
    args, row = _run(path)
    measured = row["peak_bytes_step1"]
    assert abs(_plan_of({**args, "offload_modules": []}).ranks[0].total_bytes("none") - measured) / measured < 0.001


@pytest.mark.parametrize("plain, offloaded", [("F4-local-det", "P4-local-dense5-det"),
                                              ("F5-local-attndropout-det", "P5-local-attndropout-core-det")])
def test_local_spec_bytes_exact_and_peak_an_upper_bound(plain, offloaded):
    """The local spec (unfused attention in PyTorch, fp32 softmax, s 2048), predicted before it ran (call 4):
    every point's bytes per step exact (the fp32 and 16-bit probabilities, the dropout mask and dropped
    probabilities, read from megatron-core's source); the no-offload peak 1.7 % (F4) and 5.0 % (F5, attention
    dropout) high: the backward working set is TE's, larger than the local spec's. The peak reduction was
    projected at 1304 and 944 MiB and measured 272 MiB: the copies (5.1 GiB a step, 8.4 ms of link a layer
    against about 2 ms of forward) trail the forward, and the peak moves into the last layer's forward, before
    any copy has landed (no byte off the device at the peak). The projection is an upper bound there."""
    import test_plan_validation as validation

    _, base = _run(f"call4/{plain}")
    off_args, row = _run(f"call4/{offloaded}")
    measured_delta = base["peak_bytes_step1"] - row["peak_bytes_step1"]
    m = validation.Measurement("local spec", tuple(off_args["offload_modules"]), 0, measured_delta,
                               row["offload"]["off_device_at_peak_bytes"], validation.offloaded_by_point(row),
                               off_args, True, "s57", "predicted before it ran")
    compared = validation.compare(m)  # core_attn and attn_proj as one where the runtime counts them so
    assert all(predicted == measured for _, predicted, measured in compared.points)
    assert {p for p, b in m.offloaded.items() if b} <= {p for p, _, _ in compared.points}  # none unforeseen
    predicted_peak = validation.plan_for(m).ranks[0].total_bytes("none")
    assert 0 < (predicted_peak - base["peak_bytes_step1"]) / base["peak_bytes_step1"] < 0.05
    assert compared.delta_peak[0] > 3 * measured_delta > 0
    assert row["offload"]["off_device_at_peak_bytes"] == 0
    assert row["loss_hex"] == base["loss_hex"]


SEQUENTIAL = ROOT / "benchmarks" / "results" / "session80-module-kinds" / "seq" / "results.tgz"
FINE = ROOT / "benchmarks" / "results" / "session81-fine-experts" / "fine" / "results.tgz"
FINE_FP8 = ROOT / "benchmarks" / "results" / "session81-fine-experts" / "lease2" / "results.tgz"


def _sequential_runs(tarball) -> dict[str, dict]:
    """The JSON of each run in a GPU test's tarball (read in place), by its path there without ``.json``."""
    import tarfile

    with tarfile.open(tarball) as tar:
        return {m.name.removesuffix(".json"): json.load(tar.extractfile(m))
                for m in tar.getmembers() if m.name.endswith(".json") and "__" in m.name}


def test_fp8_sequential_experts_against_the_planner():
    """Session 81's lease 2 (1 x H200): C's model at 4 layers, FP8 delayed scaling, SequentialMLP experts, predicted
    before it ran. expert_fc1 (each expert's FP8 input, accepted without grouped GEMM) and moe_act both moved 96.1 %
    of the projection (the experts routed under 512 rows kept theirs); the no-offload peak 1.0 % over it."""
    runs = _sequential_runs(FINE_FP8)
    base = runs["pt/test_fp8_sequential_experts_of0/C/C__baseline__mc-0.15.3__none"]
    ours = runs["pt/test_fp8_sequential_experts_of0/C/C__ours__mc-0.15.3__expert_fc1+moe_act"]
    assert ours["args"]["fp8"] == "hybrid" and ours["args"]["no_moe_grouped_gemm"]
    measured = base["ranks"][0]["peak_bytes_step1"]
    projected_peak = _plan_of({**base["args"], "offload_modules": []}).ranks[0].total_bytes("none")
    assert 0 < (measured - projected_peak) / measured < 0.01
    moved = {p: row["offloaded"] for p, row in ours["ranks"][0]["offload"]["last_step"].items()}
    projected = _plan_of(ours["args"]).offloaded_per_step(["expert_fc1", "moe_act"])[0]
    assert projected == {"expert_fc1": 384 * MIB, "moe_act": 768 * MIB}
    for point in projected:
        assert 0.95 * projected[point] < moved[point] < projected[point]


def test_sequential_mlp_experts_peak_and_bytes():
    """C's model at 4 layers with Megatron-LM's SequentialMLP experts (pretrain_gpt.py --no-moe-grouped-gemm,
    1 x H200, session 80; compared after the runs). Without offloading the projection is 0.6 % under the measured
    peak; modelled as grouped GEMM it was 2.1 % over it (TE's four multi-stream workspaces, 128 MiB, which a
    SequentialMLP does not take). expert_fc1 moves the permuted tokens exactly; moe_act, one fc1 output per
    expert, is an upper bound: the experts routed under 512 rows kept theirs (726 of 768 MiB)."""
    runs = _sequential_runs(SEQUENTIAL)
    run_of = "pt/test_other_module_kinds_equal_0/C/C__{}__mc-0.15.3__{}".format
    base = runs[run_of("baseline", "none")]
    measured = base["ranks"][0]["peak_bytes_step1"]
    args = {**base["args"], "offload_modules": []}
    sequential = _plan_of(args).ranks[0].total_bytes("none")
    grouped = _plan_of({**args, "no_moe_grouped_gemm": False}).ranks[0].total_bytes("none")
    assert abs(sequential - measured) / measured < 0.01
    assert grouped - sequential == 4 * CUBLAS_WORKSPACE_BYTES and (grouped - measured) / measured > 0.02
    for modules in ("expert_fc1+moe_act", "qkv_linear+core_attn+attn_proj+mlp_norm+expert_fc1+moe_act"):
        run = runs[run_of("ours", modules)]
        moved = {p: row["offloaded"] for p, row in run["ranks"][0]["offload"]["last_step"].items()}
        projected = _plan_of(run["args"]).offloaded_per_step(modules.split("+"))[0]
        assert moved["expert_fc1"] == projected["expert_fc1"]
        assert 0.9 * projected["moe_act"] < moved["moe_act"] < projected["moe_act"]


def test_sequential_mlp_experts_under_the_size_threshold_move_nothing():
    """A fine-grained MoE (64 experts, top-2, FFN 512: 128 rows an expert under balanced routing) as a SequentialMLP:
    each expert's fc1 output, 128 x 1024 elements, stays under the default min_offloaded_tensor_size, so moe_act
    moves nothing and the plan says why and what would move it; as one grouped GEMM it moves the whole fc1 output,
    as it does with a threshold under one expert's output."""
    fine = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, swiglu=True,
                     num_experts=64, moe_router_topk=2, moe_ffn_hidden_size=512)
    sequential = plan_for(fine, num_microbatches=2, moe_grouped_gemm=False, offload_modules=("moe_act",))
    point = sequential.layers["moe"].points["moe_act"]
    assert point.offloaded_bytes == 0
    assert "131072 elements" in point.note and "1024 rows or more moves its own" in point.note
    assert "--moe-grouped-gemm" in point.note
    assert any(w.startswith("requested moe_act moves nothing here") for w in sequential.warnings)
    assert any("each of the 64 local experts runs its own" in w for w in sequential.warnings)
    grouped = plan_for(fine, num_microbatches=2, offload_modules=("moe_act",))
    assert not any("local experts opens" in w for w in grouped.warnings)
    rows = 4096 * 2
    # the fp32 probabilities are small and stay
    assert grouped.layers["moe"].points["moe_act"].offloaded_bytes == rows * 2 * 512 * 2
    lowered = plan_for(fine, num_microbatches=2, moe_grouped_gemm=False, min_offloaded_tensor_size=131072)
    assert lowered.layers["moe"].points["moe_act"].offloaded_bytes == rows * 2 * 512 * 2


def test_fine_grained_sequential_experts_against_the_planner():
    """Session 81 (1 x H200): C's model at 4 layers with 64 SequentialMLP experts, top-2, FFN 512, predicted before
    it ran (benchmarks/results/session81-fine-experts/README.md). Met: the no-offload peak within 0.5 % (5599.2 MiB
    projected, 5616.7 and 5621.9 measured; 2.0 % high with grouped GEMM's workspaces), expert_fc1 exact, and with
    min_offloaded_tensor_size 65536 moe_act at 93 % of the projection, under it. Missed: at the default threshold
    the projection (balanced routing) was 0 and the run moved 41 MiB a step, the experts routed 1024 rows or more,
    eight times the balanced 128; the plan's note has said so since."""
    runs = _sequential_runs(FINE)
    for test, threshold in (("test_fine_grained_sequential_e0", None), ("test_fine_grained_sequential_e1", 65536)):
        base = runs[f"pt/{test}/C/C__baseline__mc-0.15.3__none"]
        ours = runs[f"pt/{test}/C/C__ours__mc-0.15.3__expert_fc1+moe_act"]
        assert ours["args"]["min_offloaded_tensor_size"] == (threshold or 1048576)
        measured = base["ranks"][0]["peak_bytes_step1"]
        plan = _plan_of({**base["args"], "offload_modules": []})
        assert abs(plan.ranks[0].total_bytes("none") - measured) / measured < 0.005
        moved = {p: row["offloaded"] for p, row in ours["ranks"][0]["offload"]["last_step"].items()}
        projected = _plan_of(ours["args"]).offloaded_per_step(["expert_fc1", "moe_act"])[0]
        assert moved["expert_fc1"] == projected["expert_fc1"] == 384 * MIB
        if threshold:
            assert 0.9 * projected["moe_act"] < moved["moe_act"] < projected["moe_act"] == 192 * MIB
        else:
            assert projected["moe_act"] == 0 and 40 * MIB < moved["moe_act"] < 42 * MIB
