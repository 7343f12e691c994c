"""``mcore-offload plan``: Megatron-LM-style flags (or a preset) in, the per-rank offload plan out.

Runs on a CPU in well under a second: it imports neither torch nor megatron.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from mcore_offload.config import DEFAULT_MIN_OFFLOADED_TENSOR_SIZE, OFFLOAD_MODULES
from mcore_offload.plan.hardware import Hardware, get_hardware, gpu_names, with_link_overrides
from mcore_offload.plan.measure import load_measured
from mcore_offload.plan.model import (
    FP8_FORMATS,
    FP8_RECIPES,
    POSITION_EMBEDDING_TYPES,
    ModelSpec,
    ParallelLayout,
    PlanError,
    TrainingSpec,
    get_preset,
    parse_moe_layer_freq,
    preset_names,
    with_overrides,
)
from mcore_offload.plan.planner import PlanConfig, build_plan
from mcore_offload.plan.report import format_table, write_json, write_png

DEFAULT_MICROBATCHES_PER_STAGE = 4


#: Megatron-LM's default --hidden-dropout and --attention-dropout
MEGATRON_LM_DROPOUT = 0.1


def _model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (Megatron-LM flags; they override a preset's values)")
    g.add_argument("--preset", help=f"start from a public architecture: {', '.join(preset_names())}")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--num-query-groups", "--kv-channels",
                 "--ffn-hidden-size", "--vocab-size", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                 "--moe-shared-expert-intermediate-size"):
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--group-query-attention", action="store_true",
                   help="accepted for compatibility; --num-query-groups is honoured either way")
    g.add_argument("--moe-layer-freq", default=None, help="1, k (every k-th layer), or e.g. '([0]*3+[1]*58)'")
    g.add_argument("--swiglu", action="store_true", default=None, help="gated SwiGLU MLP (presets set it)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, default=None,
                   help="default rope (every preset's; Megatron-LM's own default is learned_absolute)")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="learned_absolute's table length (default the sequence length)")


def _layout_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel layout")
    for flag, default in (("--tensor-model-parallel-size", 1), ("--pipeline-model-parallel-size", 1),
                          ("--expert-model-parallel-size", 1)):
        g.add_argument(flag, type=int, default=default)
    for flag in ("--num-layers-per-virtual-pipeline-stage", "--virtual-pipeline-model-parallel-size",
                 "--expert-tensor-parallel-size", "--decoder-first-pipeline-num-layers",
                 "--decoder-last-pipeline-num-layers"):
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")


def _training_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--seq-length", type=int, default=4096)
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--num-microbatches", type=int, default=None,
                   help=f"default: --global-batch-size / (mbs x DP), else {DEFAULT_MICROBATCHES_PER_STAGE} x PP")
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="only to turn --global-batch-size into microbatches (default EP x ETP / TP, at least 1)")
    dtype = g.add_mutually_exclusive_group()
    dtype.add_argument("--bf16", action="store_true")
    dtype.add_argument("--fp16", action="store_true")
    g.add_argument("--transformer-impl", choices=["transformer_engine", "local"], default="transformer_engine")
    g.add_argument("--fp8-format", choices=FP8_FORMATS, default=None,
                   help="TE's FP8 GEMMs: linears keep their inputs in FP8, weights an FP8 copy and its transpose")
    g.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="delayed",
                   help="with --fp8-format; the planner models delayed scaling")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron-LM's shortcut for --recompute-granularity selective")
    g.add_argument("--recompute-modules", nargs="*", default=[])
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="with --recompute-granularity full: uniform checkpoints every layer, block the first "
                        "--recompute-num-layers of each model chunk")
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--offload-modules", nargs="+", default=[], metavar="POINT",
                   help=f"the set to evaluate next to the planner's own: {', '.join(OFFLOAD_MODULES)}")
    g.add_argument("--min-offloaded-tensor-size", type=int, default=DEFAULT_MIN_OFFLOADED_TENSOR_SIZE)
    g.add_argument("--deterministic-mode", action="store_true",
                   help="torch deterministic algorithms: MoE layers keep their expert output for unpermute's backward")
    g.add_argument("--moe-permute-fusion", action="store_true", help="TE's fused MoE (un)permutation")
    g.add_argument("--moe-grouped-gemm", action="store_true", default=None,
                   help="the experts as one grouped GEMM (presets assume it, as their public recipes pass it); "
                        "without it, Megatron-LM's SequentialMLP: one fc1 output per expert, each under "
                        "--min-offloaded-tensor-size on its own")
    g.add_argument("--no-moe-grouped-gemm", dest="moe_grouped_gemm", action="store_false",
                   help="SequentialMLP experts with a preset")
    g.add_argument("--context-parallel-size", type=int, default=1, help="only 1: context parallelism is not modelled")
    g.add_argument("--no-rope-fusion", dest="rope_fusion", action="store_false",
                   help="unfused RoPE: every layer keeps its cos and sin")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                   help="local spec: PyTorch's softmax, in fp32, whose output every layer keeps")
    for flag in ("--hidden-dropout", "--attention-dropout"):
        g.add_argument(flag, type=float, default=None,
                       help="default Megatron-LM's 0.1, or 0 with a preset (their recipes train without dropout)")


def _output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hardware and output")
    g.add_argument("--gpu", default=None, help=f"{', '.join(gpu_names())} (default h100)")
    g.add_argument("--hardware-json", metavar="PATH", default=None,
                   help="the machine as 'mcore-offload measure --json-out PATH' measured it (instead of --gpu)")
    g.add_argument("--link-gbps", type=float, default=None, help="host link GB/s, each direction")
    g.add_argument("--link-both-gbps", type=float, default=None, help="host link GB/s, both directions at once")
    g.add_argument("--tflops", type=float, default=None, help="dense bf16 GEMM TFLOP/s")
    g.add_argument("--memory-target-gib", type=float, default=None,
                   help="per-rank budget: offload just enough to bring the projected peak under it")
    g.add_argument("--max-exposed-percent", type=float, default=2.0,
                   help="transfer time allowed to stay exposed, percent of compute (default 2)")
    g.add_argument("--json", metavar="PATH", default=None, help="also write the plan as JSON")
    g.add_argument("--png", metavar="PATH", default=None, help="also write a bar chart (needs matplotlib)")
    g.add_argument("--ignore-unknown-args", action="store_true",
                   help="plan from a whole Megatron-LM command line: flags the planner does not read (optimizer, "
                        "data, logging) are skipped and listed in the notes")


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan`` on the ``mcore-offload`` command line."""
    p = subparsers.add_parser("plan", help="project per-rank peak memory and pick offload_modules (CPU only)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_flags(p)
    _layout_flags(p)
    _training_flags(p)
    _output_flags(p)
    p.set_defaults(func=run_plan)
    return p


def _model(args: argparse.Namespace) -> ModelSpec:
    freq = None if args.moe_layer_freq is None else parse_moe_layer_freq(args.moe_layer_freq)
    overrides = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                     kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.vocab_size,
                     swiglu=args.swiglu, untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                     num_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                     moe_ffn_hidden_size=args.moe_ffn_hidden_size,
                     moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                     moe_layer_freq=freq, position_embedding_type=args.position_embedding_type,
                     max_position_embeddings=args.max_position_embeddings)
    if args.preset is not None:
        return with_overrides(get_preset(args.preset), **overrides)
    missing = [f for f, v in (("--num-layers", args.num_layers), ("--hidden-size", args.hidden_size),
                              ("--num-attention-heads", args.num_attention_heads)) if v is None]
    if missing:
        raise PlanError(f"No model given ({', '.join(missing)} missing): pass --preset NAME or describe the model "
                        "with --num-layers, --hidden-size and --num-attention-heads.")
    if args.hidden_size is not None and args.ffn_hidden_size is None:
        overrides["ffn_hidden_size"] = 4 * args.hidden_size  # Megatron-LM's default
    return ModelSpec(**{k: v for k, v in overrides.items() if v is not None})


def _vpp(args: argparse.Namespace, model: ModelSpec) -> int | None:
    vpp, pp = args.virtual_pipeline_model_parallel_size, args.pipeline_model_parallel_size
    per_stage = args.num_layers_per_virtual_pipeline_stage
    if per_stage is None:
        return vpp
    if per_stage <= 0 or pp <= 0 or model.num_layers % (pp * per_stage):
        raise PlanError(f"--num-layers {model.num_layers} is not divisible by PP x "
                        f"--num-layers-per-virtual-pipeline-stage ({pp} x {per_stage}); pick sizes that divide it.")
    derived = model.num_layers // (pp * per_stage)
    if vpp is not None and vpp != derived:
        raise PlanError(f"--virtual-pipeline-model-parallel-size {vpp} contradicts "
                        f"--num-layers-per-virtual-pipeline-stage {per_stage} ({derived} chunks); pass only one.")
    return derived if derived > 1 else None


def _microbatches(args: argparse.Namespace, layout: ParallelLayout) -> tuple[int, str | None]:
    if args.num_microbatches is not None:
        return args.num_microbatches, None
    if args.global_batch_size is None:
        m = DEFAULT_MICROBATCHES_PER_STAGE * layout.pp
        return m, f"--num-microbatches not given: assumed {DEFAULT_MICROBATCHES_PER_STAGE} x PP = {m}"
    dp = args.data_parallel_size or max(1, layout.ep * layout.etp // layout.tp)
    per_step = args.micro_batch_size * dp
    if dp <= 0 or args.micro_batch_size <= 0 or args.global_batch_size % per_step:
        raise PlanError(f"--global-batch-size {args.global_batch_size} is not divisible by micro-batch size x "
                        f"data-parallel size ({args.micro_batch_size} x {dp}); fix one of them or pass "
                        "--num-microbatches.")
    return args.global_batch_size // per_step, None


def _dropout(value: float | None, preset: str | None) -> float:
    if value is None:
        return 0.0 if preset else MEGATRON_LM_DROPOUT
    if not 0 <= value < 1:
        raise PlanError(f"a dropout probability must lie in [0, 1), got {value:g}; pass e.g. --hidden-dropout 0.1.")
    return value


def _grouped_gemm(value: bool | None, preset: str | None) -> bool:
    """Megatron-LM's default is SequentialMLP experts; the presets' public recipes pass --moe-grouped-gemm."""
    return bool(preset) if value is None else value


def config_from_args(args: argparse.Namespace) -> tuple[PlanConfig, list[str]]:
    """The plan configuration the flags describe, plus notes about assumed values."""
    model = _model(args)
    layout = ParallelLayout(
        tensor_model_parallel_size=args.tensor_model_parallel_size, sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=_vpp(args, model),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers)
    if args.context_parallel_size != 1:
        raise PlanError(f"--context-parallel-size {args.context_parallel_size}: context parallelism is not modelled, "
                        "so this plan would be wrong; plan without it (--context-parallel-size 1).")
    granularity = args.recompute_granularity
    if args.recompute_activations:
        if granularity not in (None, "selective"):
            raise PlanError(f"--recompute-activations means --recompute-granularity selective, which contradicts "
                            f"--recompute-granularity {granularity}; pass only one of them.")
        granularity = "selective"
    m, note = _microbatches(args, layout)
    # Presets are bf16 models; without a preset Megatron-LM's default (fp32) applies.
    dtype = "fp16" if args.fp16 else "bf16" if args.bf16 or args.preset else "fp32"
    training = TrainingSpec(seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, num_microbatches=m,
                            dtype=dtype, transformer_impl=args.transformer_impl,
                            recompute_granularity=granularity,
                            recompute_modules=tuple(args.recompute_modules),
                            recompute_method=args.recompute_method,
                            recompute_num_layers=args.recompute_num_layers,
                            offload_modules=tuple(args.offload_modules),
                            min_offloaded_tensor_size=args.min_offloaded_tensor_size,
                            deterministic=args.deterministic_mode, moe_permute_fusion=args.moe_permute_fusion,
                            rope_fusion=args.rope_fusion, masked_softmax_fusion=args.masked_softmax_fusion,
                            hidden_dropout=_dropout(args.hidden_dropout, args.preset),
                            attention_dropout=_dropout(args.attention_dropout, args.preset),
                            fp8_format=args.fp8_format, fp8_recipe=args.fp8_recipe,
                            moe_grouped_gemm=_grouped_gemm(args.moe_grouped_gemm, args.preset))
    hw = _hardware(args)
    if not 0 <= args.max_exposed_percent <= 100:
        raise PlanError(f"--max-exposed-percent must lie between 0 and 100, got {args.max_exposed_percent:g}; "
                        "the default is 2.")
    config = PlanConfig(model, layout, training, hw, args.memory_target_gib, args.max_exposed_percent / 100)
    notes = [note] if note else []
    if model.num_experts and args.moe_grouped_gemm is None:
        notes.append("--moe-grouped-gemm " + ("assumed, as the preset's public recipe passes it (--no-moe-grouped-gemm "
                                              "for SequentialMLP experts)" if args.preset else
                                              "not given: the experts are Megatron-LM's SequentialMLP"))
    ignored = getattr(args, "ignored_args", None)  # set by mcore_offload.cli under --ignore-unknown-args
    if ignored:
        notes.append(f"--ignore-unknown-args: skipped {' '.join(ignored)} (not read by the planner)")
    if training.fp8 and args.tflops is None:
        notes.append("--fp8-format: layer times use the bf16 GEMM rate, and FP8 GEMMs run faster, so less compute "
                     "hides the copies than shown; pass --tflops with your FP8 rate for the cautious estimate")
    return config, notes


def _hardware(args: argparse.Namespace) -> Hardware:
    overrides = (args.link_gbps, args.link_both_gbps, args.tflops)
    if args.hardware_json is None:
        return get_hardware(args.gpu or "h100", *overrides)
    if args.gpu is not None:
        raise PlanError(f"pass either --gpu {args.gpu} or --hardware-json, not both: the measured file already "
                        "describes the GPU.")
    return with_link_overrides(load_measured(args.hardware_json).hardware(), *overrides)


def run_plan(args: argparse.Namespace) -> int:
    """Build, print and optionally save the plan; 2 on bad input, 1 when an output could not be written."""
    try:
        config, notes = config_from_args(args)
        plan = build_plan(config)
    except PlanError as exc:
        print(f"mcore-offload plan: {exc}", file=sys.stderr)
        return 2
    if notes:
        plan = dataclasses.replace(plan, warnings=(*notes, *plan.warnings))
    print(format_table(plan), end="")
    status = 0
    if args.json:
        try:
            write_json(plan, args.json)
        except OSError as exc:
            print(f"mcore-offload plan: cannot write {args.json} ({exc.strerror}); pass a writable --json path.",
                  file=sys.stderr)
            status = 1
    if args.png:
        try:
            written = write_png(plan, args.png)
        except OSError as exc:
            print(f"mcore-offload plan: cannot write {args.png} ({exc.strerror}); pass a writable --png path.",
                  file=sys.stderr)
            return 1
        if not written:
            print("mcore-offload plan: matplotlib is not installed, so no PNG was written; "
                  "install it with 'pip install matplotlib'.", file=sys.stderr)
            status = 1
    return status
