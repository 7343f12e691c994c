"""``mcore-offload plan --fp8-format``: what TE's FP8 linears keep (one byte an element) and hold (an FP8 copy of
each weight and its transpose), and the combinations refused with one sentence. The GPU runs these terms follow
(session 63, A and C at 4 layers) are checked in tests/test_plan_validation.py."""

from __future__ import annotations

import pytest

from mcore_offload.cli import main
from mcore_offload.plan import ParallelLayout, PlanError, layer_activations
from mcore_offload.plan.planner import layer_params, linear_weights
from tests.test_plan import DENSE, MIB, MOE, plan_for, training

FP8 = {"fp8_format": "hybrid"}


def test_fp8_points_keep_one_byte_copies_and_core_attn_takes_the_attention_output():
    bf16 = layer_activations(DENSE, ParallelLayout(), training(), moe=False)
    fp8 = layer_activations(DENSE, ParallelLayout(), training(**FP8), moe=False)
    got = {name: fp8.points[name].offloaded_bytes // MIB for name in ("qkv_linear", "core_attn", "attn_proj")}
    # seq 4096, hidden 2048: the layer input 16 MiB in bf16 and the norm output 8 in FP8; q, k, v 48 and the
    # attention output 16 in bf16; the projection's own FP8 copy 8 (session 63's A: 224 / 768 / 96 over 12 layers)
    assert got == {"qkv_linear": 24, "core_attn": 64, "attn_proj": 8}
    assert fp8.points["qkv_linear"].first_layer_bytes == 8 * MIB  # the chunk's first layer: its input stays
    assert bf16.points["core_attn"].offloaded_bytes == 48 * MIB and bf16.points["attn_proj"].offloaded_bytes == 16 * MIB
    # the dense MLP's norm output (16 -> 8) and fc2's input (64 -> 32), the attention norm output (16 -> 8) and
    # the projection's input (a second, FP8 storage: +8)
    assert (bf16.total_bytes - fp8.total_bytes) // MIB == 8 + 32 + 8 - 8


def test_fp8_moe_keeps_the_experts_inputs_in_fp8_and_refuses_expert_fc1():
    bf16 = layer_activations(MOE, ParallelLayout(), training(), moe=True)
    fp8 = layer_activations(MOE, ParallelLayout(), training(**FP8), moe=True)
    assert fp8.points["expert_fc1"].offloaded_bytes == 0 and "Float8Tensor" in fp8.points["expert_fc1"].note
    assert fp8.points["moe_act"].offloaded_bytes == bf16.points["moe_act"].offloaded_bytes  # fc1's 16-bit output
    assert fp8.points["mlp_norm"].offloaded_bytes == bf16.points["mlp_norm"].offloaded_bytes == 16 * MIB
    rows = 4096 * 4
    # permuted tokens (rows x 2048) and the activation output (rows x 1024) at one byte instead of two; in the
    # attention part the norm output's 8 MiB saved pay for the projection's FP8 copy
    assert bf16.total_bytes - fp8.total_bytes == rows * 2048 + rows * 1024


def test_fp8_weight_copies_are_two_bytes_per_linear_weight():
    """Session 63's offload audit: TE's FP8 weight workspaces were 512 MiB on A at 4 layers and 896 MiB on C at 4
    layers (every linear weight, an FP8 copy and its transpose); norms and the router are not FP8 linears."""
    assert 4 * linear_weights(DENSE, ParallelLayout(), moe=False) * 2 == 512 * MIB
    assert 4 * linear_weights(MOE, ParallelLayout(), moe=True) * 2 == 896 * MIB
    assert linear_weights(DENSE, ParallelLayout(), moe=False) == layer_params(DENSE, ParallelLayout(), False) - 4096
    bf16, fp8 = plan_for(DENSE), plan_for(DENSE, **FP8)
    assert fp8.ranks[0].static_bytes - bf16.ranks[0].static_bytes == 16 * linear_weights(DENSE, ParallelLayout(),
                                                                                          moe=False) * 2


@pytest.mark.parametrize(("kw", "words"), [
    ({"transformer_impl": "local"}, "needs the TE spec"),
    ({"dtype": "fp32"}, "16-bit training"),
    ({"fp8_recipe": "mxfp8"}, "not modelled"),
    ({"fp8_format": "e5m2"}, "Unknown --fp8-format"),
    ({"fp8_recipe": "per-block"}, "Unknown --fp8-recipe"),
])
def test_fp8_combinations_the_planner_cannot_model_get_one_sentence(kw, words):
    with pytest.raises(PlanError, match=words):
        plan_for(DENSE, **{**FP8, **kw})


def test_fp8_with_expert_fc1_is_refused_as_a_run_would_be():
    with pytest.raises(PlanError, match="drop expert_fc1"):
        plan_for(MOE, **FP8, offload_modules=("expert_fc1", "moe_act"))
    plan_for(MOE, **FP8, offload_modules=("moe_act",))  # moe_act still offloads
    plan_for(DENSE, **FP8, offload_modules=("core_attn",))


def test_fp8_sequential_experts_move_their_own_fp8_inputs():
    """Without grouped GEMM (a SequentialMLP of TE linears) a run accepts expert_fc1 under FP8 (config.py refuses
    only the grouped linear's Float8Tensor objects): each expert's linear quantizes its own input and saves it as
    plain tensors, as the dense projections do, so expert_fc1 moves the FP8 inputs, one storage per expert, and the
    layer keeps the same bytes as with grouped GEMM."""
    seq = dict(FP8, moe_grouped_gemm=False)
    grouped = layer_activations(MOE, ParallelLayout(), training(**FP8), moe=True)
    sequential = layer_activations(MOE, ParallelLayout(), training(**seq), moe=True)
    rows = 4096 * 4
    assert sequential.points["expert_fc1"].offloaded_bytes == rows * 2048  # one byte an element
    assert "quantized by its own TE linear" in sequential.points["expert_fc1"].note
    assert sequential.total_bytes == grouped.total_bytes
    assert sequential.points["moe_act"].offloaded_bytes == grouped.points["moe_act"].offloaded_bytes
    plan_for(MOE, **seq, offload_modules=("expert_fc1", "moe_act"))  # not refused


def test_cli_takes_megatron_lms_fp8_flags(capsys):
    assert main(["plan", "--preset", "llama3-8b", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"]) == 0
    out = capsys.readouterr().out
    assert "bf16 with fp8 hybrid (delayed)" in out and "pass --tflops with your FP8 rate" in out
    assert main(["plan", "--preset", "llama3-8b", "--fp8-format", "hybrid", "--tflops", "1500"]) == 0
    assert "--tflops with your FP8 rate" not in capsys.readouterr().out  # the rate given is the user's
    assert main(["plan", "--preset", "llama3-8b", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]) == 2
    assert "--fp8-recipe mxfp8 is not modelled" in capsys.readouterr().err


def test_fp8_lets_attn_proj_go_alone_in_the_plan_and_in_a_runs_config():
    """Under FP8 the projection saves its own FP8 copy of attention's output (session 63: 224 MiB on A at 4 layers,
    apart from core_attn's), so attn_proj alone frees that copy: the planner plans it, shows it as a set of its own
    and may recommend it (a run's config accepts it: tests/test_config.py). Without FP8 it is refused (the same
    tensor as core_attn's)."""
    from mcore_offload.plan.recommend import valid_sets

    plan = plan_for(DENSE, **FP8, offload_modules=("attn_proj",))
    freed = {s.label: s for s in plan.sets}
    assert "attn_proj" in freed and "core_attn+attn_proj" not in freed
    assert plan.offloaded_per_step(("attn_proj",))[0]["attn_proj"] > 0
    assert ("attn_proj",) in valid_sets(["core_attn", "attn_proj"], attn_proj_alone=True)
    assert ("attn_proj",) not in valid_sets(["core_attn", "attn_proj"])
    with pytest.raises(PlanError, match="attn_proj without core_attn"):
        plan_for(DENSE, offload_modules=("attn_proj",))
