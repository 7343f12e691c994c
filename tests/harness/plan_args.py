"""``mcore-offload plan``'s flags for a run of benchmarks/pretrain_gpt.py, from the ``args`` its JSON records: how the
planner is checked against runs (tests/test_plan_validation.py on the committed results, tests/test_gpu.py on the
GPU host, where the committed results are not carried)."""

from __future__ import annotations

from functools import cache

from mcore_offload.cli import build_parser
from mcore_offload.plan import Plan, build_plan
from mcore_offload.plan.cli import config_from_args


def plan_argv(args: dict) -> list[str]:
    """``mcore-offload plan`` flags for a run of benchmarks/pretrain_gpt.py (its ``args``)."""
    argv = ["plan"]
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "vocab_size", "seq_length", "micro_batch_size", "num_microbatches", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "num_layers_per_virtual_pipeline_stage", "expert_model_parallel_size", "num_experts",
                "moe_router_topk", "moe_ffn_hidden_size", "transformer_impl", "recompute_granularity",
                "recompute_method", "recompute_num_layers", "min_offloaded_tensor_size"):
        if args.get(key) is not None and not (key == "moe_router_topk" and not args.get("num_experts")):
            argv += [f"--{key.replace('_', '-')}", str(args[key])]
    for key in ("recompute_modules", "offload_modules"):
        if args.get(key):
            argv += [f"--{key.replace('_', '-')}", *args[key]]
    if args.get("sequence_parallel"):
        argv.append("--sequence-parallel")
    if args.get("bf16"):
        argv.append("--bf16")
    if args.get("deterministic"):  # pretrain_gpt.py's --deterministic: torch's deterministic algorithms
        argv.append("--deterministic-mode")
    if not args.get("rope_fusion"):  # pretrain_gpt.py keeps TransformerConfig's apply_rope_fusion=False unless asked
        argv.append("--no-rope-fusion")
    if args["transformer_impl"] == "local":  # pretrain_gpt.py: learned absolute positions, masked_softmax_fusion=False
        argv += ["--position-embedding-type", "learned_absolute", "--no-masked-softmax-fusion"]
    if args.get("fp8"):  # pretrain_gpt.py's --fp8 FORMAT and --fp8-recipe (default delayed)
        argv += ["--fp8-format", args["fp8"], "--fp8-recipe", args.get("fp8_recipe") or "delayed"]
    if args.get("moe_permute_fusion"):
        argv.append("--moe-permute-fusion")
    # pretrain_gpt.py: the TE spec's experts are TEGroupedMLP unless --no-moe-grouped-gemm; the local spec's a
    # SequentialMLP
    if args.get("num_experts"):
        grouped = args["transformer_impl"] == "transformer_engine" and not args.get("no_moe_grouped_gemm")
        argv.append("--moe-grouped-gemm" if grouped else "--no-moe-grouped-gemm")
    for key in ("hidden_dropout", "attention_dropout"):  # pretrain_gpt.py: 0 unless asked (no flag before s56)
        argv += [f"--{key.replace('_', '-')}", str(args.get(key) or 0.0)]
    # pretrain_gpt.py: gated_linear_unit (SwiGLU) with the TE spec, share_embeddings_and_output_weights=False
    if args["transformer_impl"] == "transformer_engine":
        argv.append("--swiglu")
    argv.append("--untie-embeddings-and-output-weights")
    return argv


@cache
def _plan(argv: tuple[str, ...]) -> Plan:
    config, _ = config_from_args(build_parser().parse_args(list(argv)))
    return build_plan(config)


def plan_of_run(args: dict) -> Plan:
    """The plan of a pretrain_gpt.py run, from its JSON's ``args``."""
    return _plan(tuple(plan_argv(args)))
