"""The planner on megatron-core's local spec (unfused attention, learned absolute positions): what its core
attention keeps of the s^2 probabilities, read from megatron-core 0.15.3's DotProductAttention and
FusedScaleMaskSoftmax, and the static buffers it adds (CPU only; the GPU runs that check the numbers are
benchmarks/results/planner-fused-paths-session57)."""

from __future__ import annotations

import pytest

from mcore_offload.plan import ModelSpec, ParallelLayout, PlanConfig, TrainingSpec, build_plan, get_hardware
from mcore_offload.plan.activations import layer_activations
from mcore_offload.plan.planner import workspace_bytes

DENSE = ModelSpec(num_layers=4, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192)
SEQ = 2048
T_A_S = SEQ * 16 * SEQ  # probabilities' elements a layer at micro-batch 1


def local(**kw) -> TrainingSpec:
    return TrainingSpec(**{"seq_length": SEQ, "dtype": "bf16", "transformer_impl": "local", **kw})


def core_attn_bytes(**kw) -> int:
    return layer_activations(DENSE, ParallelLayout(), local(**kw), moe=False).points["core_attn"].offloaded_bytes


@pytest.mark.parametrize(("fusion", "dropout", "probability_bytes"), [
    (True, 0.0, 2),   # the fused kernel's 16-bit output, the context matmul's input too
    (True, 0.1, 5),   # + dropout's one-byte mask and the dropped 16-bit probabilities the matmul keeps
    (False, 0.0, 6),  # PyTorch's softmax keeps its fp32 output, the matmul the 16-bit cast
    (False, 0.1, 7),  # fp32 output, mask, dropped probabilities (the 16-bit cast is kept by nothing)
])
def test_local_core_attention_keeps_its_probabilities_as_megatron_core_does(fusion, dropout, probability_bytes):
    qkv_bytes = SEQ * 3 * 2048 * 2
    assert core_attn_bytes(masked_softmax_fusion=fusion, attention_dropout=dropout) == \
        qkv_bytes + probability_bytes * T_A_S


def test_fp32_training_keeps_one_copy_of_the_probabilities():
    assert core_attn_bytes(dtype="fp32", masked_softmax_fusion=False) == SEQ * 3 * 2048 * 4 + 4 * T_A_S


def test_local_spec_static_buffers_and_learned_positions():
    """The scores' global buffer (micro-batch x heads x s^2, 16-bit), the unfused softmax's cached causal mask
    (s^2 bools), no RoPE frequencies; a learned position table on the first stage (positions x hidden, weight and
    grad)."""
    hw = get_hardware("h100")
    te = PlanConfig(DENSE, ParallelLayout(), TrainingSpec(seq_length=SEQ, dtype="bf16"), hw)
    unfused = PlanConfig(DENSE, ParallelLayout(), local(masked_softmax_fusion=False), hw)
    fused = PlanConfig(DENSE, ParallelLayout(), local(), hw)
    rope_freqs = SEQ * 128 * 4
    te_workspaces = workspace_bytes(te, False) - rope_freqs
    assert workspace_bytes(fused, False) == rope_freqs + te_workspaces - 2**25 + 2 * T_A_S
    assert workspace_bytes(unfused, False) == workspace_bytes(fused, False) + SEQ * SEQ
    learned = ModelSpec(num_layers=4, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                        position_embedding_type="learned_absolute")
    gained = build_plan(PlanConfig(learned, ParallelLayout(), local(), hw)).ranks[0].static_bytes - \
        build_plan(fused).ranks[0].static_bytes
    assert gained == SEQ * 2048 * 2 * 2 - rope_freqs


@pytest.mark.parametrize("argv, message", [
    (["--max-position-embeddings", "0"], "--max-position-embeddings must be a positive integer, got 0"),
    (["--position-embedding-type", "learned_absolute", "--max-position-embeddings", "1024"],
     "--max-position-embeddings (1024) is below --seq-length (2048)"),
])
def test_bad_position_table_is_one_sentence(capsys, argv, message):
    from mcore_offload.cli import main

    model = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048"]
    assert main(["plan", *model, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_an_exposed_requested_set_points_to_the_copy_out_bound():
    """P4's set (all five dense points, session 57): its copies cannot keep up with the forward, so the plan says its
    Δpeak is an upper bound and, for tight memory, names MCORE_OFFLOAD_D2H_IN_FLIGHT=1 (session 58); a hidden set
    gets no such note."""
    hw = get_hardware("h200")
    five = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
    exposed = build_plan(PlanConfig(DENSE, ParallelLayout(), local(masked_softmax_fusion=False,
                                                                   offload_modules=five), hw))
    note = next(w for w in exposed.warnings if w.startswith("the requested set leaves"))
    assert "an upper bound where they trail it" in note and "MCORE_OFFLOAD_D2H_IN_FLIGHT=1" in note
    hidden = build_plan(PlanConfig(DENSE, ParallelLayout(), local(offload_modules=("attn_norm",)), hw))
    assert not any("MCORE_OFFLOAD_D2H_IN_FLIGHT" in w for w in hidden.warnings)
