"""``mcore_offload.megatron_args``: the three flags reach a patched ``TransformerConfig`` the way Megatron-LM's
``core_transformer_config_from_args`` copies parsed flags (by field name), with upstream's defaults."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from mcore_offload.megatron_args import FLAGS, add_offload_args, chain_args_providers


def megatron_lm_parser() -> argparse.ArgumentParser:
    """A stand-in for Megatron-LM's parser: some of its flags, then the script's extra_args_provider."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    return parser


def config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """What Megatron-LM's core_transformer_config_from_args does with the flags: copy every field it finds."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(TransformerConfig) if hasattr(args, f.name)}
    return TransformerConfig(**kw, params_dtype=torch.float32)


def test_the_flags_reach_the_config_by_field_name():
    args = add_offload_args(megatron_lm_parser()).parse_args(
        ["--fine-grained-activation-offloading", "--offload-modules", "qkv_linear", "core_attn",
         "--min-offloaded-tensor-size", "4096"])
    config = config_from_args(args)
    assert config.fine_grained_activation_offloading is True
    assert config.offload_modules == ["qkv_linear", "core_attn"]
    assert config.min_offloaded_tensor_size == 4096


def test_without_the_flags_the_config_keeps_its_defaults():
    args = add_offload_args(megatron_lm_parser()).parse_args([])
    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    for name in ("fine_grained_activation_offloading", "min_offloaded_tensor_size"):
        assert getattr(args, name) == fields[name].default
    assert args.offload_modules == fields["offload_modules"].default_factory() == []


def test_auto_with_a_target_passes_through():
    args = add_offload_args(megatron_lm_parser()).parse_args(
        ["--fine-grained-activation-offloading", "--offload-modules", "auto:38.5"])
    assert config_from_args(args).offload_modules == ["auto:38.5"]


def test_an_unknown_module_is_the_configs_one_sentence():
    args = add_offload_args(megatron_lm_parser()).parse_args(
        ["--fine-grained-activation-offloading", "--offload-modules", "qkv"])
    with pytest.raises(ValueError, match=r"Unknown offload module\(s\) \['qkv'\]: choose from attn_norm"):
        config_from_args(args)


def test_adding_twice_is_harmless_and_a_partial_set_is_refused():
    parser = add_offload_args(add_offload_args(megatron_lm_parser()))
    assert parser.parse_args(["--offload-modules", "core_attn"]).offload_modules == ["core_attn"]
    partial = megatron_lm_parser()
    partial.add_argument("--offload-modules", nargs="*", default=[])
    with pytest.raises(ValueError, match=r"already defines --offload-modules but not the other offloading flags"):
        add_offload_args(partial)
    assert "--fine-grained-activation-offloading" not in partial._option_string_actions  # nothing half-applied


def test_chained_providers_run_in_order_and_skip_none():
    seen = []

    def mine(parser):
        seen.append("mine")
        parser.add_argument("--my-flag", type=int, default=3)
        return parser

    parser = chain_args_providers(mine, None, add_offload_args)(megatron_lm_parser())
    args = parser.parse_args(["--my-flag", "5", "--fine-grained-activation-offloading"])
    assert seen == ["mine"] and args.my_flag == 5 and args.fine_grained_activation_offloading
    assert all(flag in parser._option_string_actions for flag in FLAGS)


def test_the_benchmark_script_takes_the_same_flags():
    """benchmarks/pretrain_args.py adds them through add_offload_args: one definition."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import pretrain_args

    args = pretrain_args.parse_args(["--fine-grained-activation-offloading", "--offload-modules", "core_attn"])
    assert args.fine_grained_activation_offloading and args.offload_modules == ["core_attn"]
    assert args.min_offloaded_tensor_size == 1024 * 1024
