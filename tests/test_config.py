"""The config surface: upstream's field names and defaults, and one actionable error per mistake."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from mcore_offload.config import OFFLOAD_MODULES, validate_offload_config
from mcore_offload.patching import tooling


def make_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **kw)


def test_fields_have_upstream_names_types_and_defaults():
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    assert fields["fine_grained_activation_offloading"].default is False
    assert fields["offload_modules"].default_factory() == []
    assert fields["min_offloaded_tensor_size"].default == 1024 * 1024
    cfg = make_config()
    assert (cfg.fine_grained_activation_offloading, cfg.offload_modules,
            cfg.min_offloaded_tensor_size) == (False, [], 1024 * 1024)
    cfg = make_config(fine_grained_activation_offloading=True, offload_modules=list(OFFLOAD_MODULES),
                      min_offloaded_tensor_size=0)
    assert cfg.offload_modules == list(OFFLOAD_MODULES)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(offload_modules=["core_attn", "mlp"]),
         r"Unknown offload module\(s\) \['mlp'\]: choose from attn_norm, qkv_linear, core_attn, "
         r"attn_proj, mlp_norm, expert_fc1, moe_act, or use \['auto'\] / \['auto:<GiB>'\]\."),
        (dict(offload_modules=["auto", "core_attn"]), r"mixes 'auto' with other names; use \['auto'\]"),
        (dict(offload_modules=[]), r"needs at least one name in offload_modules: choose from attn_norm"),
        (dict(offload_modules=["attn_proj"]), r"'attn_proj' without 'core_attn'.*add 'core_attn'"),
        (dict(offload_modules=["core_attn"], cpu_offloading=True, cpu_offloading_num_layers=1),
         r"cannot be enabled together; set cpu_offloading=False"),
        (dict(offload_modules=["core_attn"], min_offloaded_tensor_size=-1),
         r"min_offloaded_tensor_size must be a non-negative number"),
        (dict(offload_modules="core_attn"), r"must be a list of names.*offload_modules=\['core_attn'\]"),
        (dict(offload_modules=["core_attn"], recompute_granularity="full", recompute_method="uniform",
              recompute_num_layers=1),
         r"nothing to offload when full recompute covers every layer.*recompute_method='uniform'.*use selective"),
        (dict(offload_modules=["core_attn"], recompute_granularity="full", recompute_method="block",
              recompute_num_layers=2),
         r"nothing to offload when full recompute covers every layer"),
        # selective recompute checkpoints these points' forward, which then saves nothing (None = megatron's default)
        (dict(offload_modules=["qkv_linear", "core_attn"], recompute_granularity="selective"),
         r"has 'core_attn', but selective recompute of 'core_attn'.*offload nothing; drop 'core_attn' from "
         r"offload_modules or 'core_attn' from recompute_modules\."),
        (dict(offload_modules=["expert_fc1"], recompute_granularity="selective", recompute_modules=["moe"],
              num_moe_experts=4), r"has 'expert_fc1', but selective recompute of 'moe'"),
        (dict(offload_modules=["moe_act"], moe_layer_recompute=True, num_moe_experts=4),
         r"has 'moe_act', but selective recompute of 'moe'"),
        # CheckpointWithoutOutput inside the point: its input gradient is lost under saved-tensor hooks
        (dict(offload_modules=["qkv_linear", "mlp_norm"], recompute_granularity="selective",
              recompute_modules=["layernorm"]),
         r"has 'mlp_norm', but selective recompute of 'layernorm' \(recompute_modules\) runs it under "
         r"CheckpointWithoutOutput.*gradients would be wrong; drop 'mlp_norm' from offload_modules"),
        (dict(offload_modules=["attn_norm"], recompute_granularity="selective", recompute_modules=["layernorm"]),
         r"has 'attn_norm', but selective recompute of 'layernorm'"),
        (dict(offload_modules=["expert_fc1", "moe_act"], recompute_granularity="selective",
              recompute_modules=["moe_act"], num_moe_experts=4, moe_grouped_gemm=True),
         r"has 'moe_act', but selective recompute of 'moe_act'.*gradients would be wrong"),
    ],
)
def test_each_validation_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_config(fine_grained_activation_offloading=True, **kwargs)


def test_selective_recompute_keeps_the_points_it_does_not_checkpoint():
    cfg = make_config(fine_grained_activation_offloading=True, recompute_granularity="selective",
                      recompute_modules=["core_attn", "layernorm", "moe_act"], num_moe_experts=4,
                      moe_grouped_gemm=True, offload_modules=["qkv_linear", "attn_proj", "expert_fc1"])
    # attn_proj alone: the core_attn checkpoint keeps no output
    assert cfg.recompute_modules == ["core_attn", "layernorm", "moe_act"]


def test_auto_leaves_out_the_points_recompute_rules_out():
    from mcore_offload.runtime.enabled import point_enabled

    cfg = make_config(fine_grained_activation_offloading=True, offload_modules=["auto"],
                      recompute_granularity="selective", recompute_modules=["layernorm", "core_attn"])
    enabled = {p for p in OFFLOAD_MODULES if point_enabled(cfg, p)}
    assert enabled == set(OFFLOAD_MODULES) - {"attn_norm", "mlp_norm", "core_attn"}
    plain = make_config(fine_grained_activation_offloading=True, offload_modules=["auto"])
    assert {p for p in OFFLOAD_MODULES if point_enabled(plain, p)} == set(OFFLOAD_MODULES)


def test_block_recompute_of_some_layers_is_accepted():
    # The layers beyond recompute_num_layers run normally and save activations that can move.
    cfg = make_config(fine_grained_activation_offloading=True, offload_modules=["core_attn"],
                      recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    assert cfg.recompute_num_layers == 1


def test_unknown_module_is_an_error_even_when_disabled():
    with pytest.raises(ValueError, match="Unknown offload module"):
        make_config(offload_modules=["qkv"])


def test_validator_accepts_plain_objects():
    class Cfg:
        fine_grained_activation_offloading = False
        offload_modules = ["core_attn"]
        min_offloaded_tensor_size = 0

    validate_offload_config(Cfg())


@pytest.mark.parametrize("graphs", [dict(enable_cuda_graph=True), dict(external_cuda_graph=True),
                                    dict(cuda_graph_impl="local")])
def test_cuda_graphs_are_refused(graphs):
    # Checked on a plain object: megatron-core's own CUDA-graph checks need a GPU build of TE.
    cfg = SimpleNamespace(fine_grained_activation_offloading=True, offload_modules=["core_attn"],
                          min_offloaded_tensor_size=0, **graphs)
    with pytest.raises(ValueError, match=r"cannot be combined with CUDA graphs .*disable CUDA graphs or offloading"):
        validate_offload_config(cfg)


def test_fp8_with_grouped_gemm_refuses_expert_fc1_and_keeps_the_rest():
    # Checked on a plain object: megatron-core's FP8 checks need a GPU build of TE.
    moe = dict(fp8="hybrid", num_moe_experts=16, moe_grouped_gemm=True, fine_grained_activation_offloading=True,
               min_offloaded_tensor_size=0)
    with pytest.raises(ValueError, match=r"'expert_fc1'.*Float8Tensor.*drop 'expert_fc1' \(moe_act still offloads\)"):
        validate_offload_config(SimpleNamespace(offload_modules=["expert_fc1", "moe_act"], **moe))
    validate_offload_config(SimpleNamespace(offload_modules=["moe_act", "core_attn"], **moe))
    for other in (dict(fp8=None), dict(moe_grouped_gemm=False)):  # bf16, or SequentialMLP: accepted
        validate_offload_config(SimpleNamespace(offload_modules=["expert_fc1"], **{**moe, **other}))


def test_fp8_lets_attn_proj_go_alone():
    """Under FP8 TE's projection saves its own FP8 copy of attention's output, which attn_proj alone frees; in 16-bit
    training core attention saves the same tensor, and attn_proj alone is refused (the parametrized case above)."""
    base = dict(fine_grained_activation_offloading=True, offload_modules=["attn_proj"], min_offloaded_tensor_size=0)
    validate_offload_config(SimpleNamespace(fp8="hybrid", **base))
    with pytest.raises(ValueError, match=r"'attn_proj' without 'core_attn'.*add 'core_attn'"):
        validate_offload_config(SimpleNamespace(fp8=None, **base))


def _run_with_megatron(root, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.getcwd()]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True)


def test_unpatched_megatron_fails_loudly_with_the_fixing_command(megatron_copy):
    result = _run_with_megatron(megatron_copy.root, """
        import mcore_offload
        try:
            mcore_offload.ensure_patched()
        except mcore_offload.NotPatchedError as e:
            print("ERROR:", e)
    """)
    assert f"ERROR: megatron-core {megatron_copy.version}" in result.stdout, result.stderr
    assert "run `mcore-offload patch apply`" in result.stdout


def test_config_patch_alone_refuses_to_enable(megatron_copy):
    """A half-patched install (fields but no offload points) must not silently offload nothing."""
    config_patch = tooling.patch_files(megatron_copy.version)[0]
    subprocess.run(["git", "apply", "-p1", str(config_patch)], cwd=megatron_copy.root, check=True)
    result = _run_with_megatron(megatron_copy.root, """
        from megatron.core.transformer.transformer_config import TransformerConfig
        TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)  # disabled: fine
        try:
            TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                              fine_grained_activation_offloading=True, offload_modules=["core_attn"])
        except RuntimeError as e:
            print("ERROR:", e)
    """)
    assert "ERROR:" in result.stdout, result.stderr
    assert "missing: attn_norm / mlp_norm points" in result.stdout
    assert "qkv_linear / core_attn / attn_proj points" in result.stdout
    assert "run `mcore-offload patch apply`" in result.stdout
