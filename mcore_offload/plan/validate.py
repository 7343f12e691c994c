"""Whether a model, a parallel layout and training settings fit together, checked as megatron-core would at
start-up: :func:`validate` raises :class:`~mcore_offload.plan.model.PlanError` with one sentence that names what is
wrong and what to do.

Kept apart from ``model.py`` (what the planner is told): the checks read every spec at once and grow with each
Megatron flag the planner learns, while the specs themselves stay plain data.
"""

from __future__ import annotations

from mcore_offload.config import (
    DEFAULT_MIN_OFFLOADED_TENSOR_SIZE,
    attn_proj_alone_frees_nothing,
    full_recompute_message,
    full_recompute_of_every_layer,
    recompute_conflict_message,
    recompute_conflicts,
    validate_offload_modules,
)
from mcore_offload.plan.model import (
    DTYPE_BYTES,
    FP8_FORMATS,
    FP8_RECIPES,
    RECOMPUTE_MODULES,
    TRANSFORMER_IMPLS,
    ModelSpec,
    ParallelLayout,
    PlanError,
    TrainingSpec,
)


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise PlanError(f"{name} must be a positive integer, got {value!r}; pass a value of at least 1.")


def _divides(what: str, total: int, by_name: str, by: int, fix: str) -> None:
    if total % by:
        raise PlanError(f"{what} ({total}) is not divisible by {by_name} ({by}); {fix}.")


def validate(model: ModelSpec, layout: ParallelLayout, training: TrainingSpec) -> None:
    """Check the three specs together, as megatron-core would at start-up; raise :class:`PlanError`."""
    for flag, value in (("--num-layers", model.num_layers), ("--hidden-size", model.hidden_size),
                        ("--num-attention-heads", model.num_attention_heads),
                        ("--ffn-hidden-size", model.ffn_hidden_size), ("--num-query-groups", model.num_query_groups),
                        ("--kv-channels", model.kv_channels), ("--vocab-size", model.vocab_size),
                        ("--num-experts", model.num_experts), ("--moe-router-topk", model.moe_router_topk),
                        ("--moe-ffn-hidden-size", model.moe_ffn_hidden_size),
                        ("--moe-shared-expert-intermediate-size", model.moe_shared_expert_intermediate_size),
                        ("--tensor-model-parallel-size", layout.tensor_model_parallel_size),
                        ("--pipeline-model-parallel-size", layout.pipeline_model_parallel_size),
                        ("--virtual-pipeline-model-parallel-size", layout.virtual_pipeline_model_parallel_size),
                        ("--expert-model-parallel-size", layout.expert_model_parallel_size),
                        ("--expert-tensor-parallel-size", layout.expert_tensor_parallel_size),
                        ("--seq-length", training.seq_length), ("--micro-batch-size", training.micro_batch_size),
                        ("--num-microbatches", training.num_microbatches),
                        ("--max-position-embeddings", model.max_position_embeddings)):
        _positive(flag, value)
    if model.position_embedding_type == "learned_absolute" and \
            (model.max_position_embeddings or training.seq_length) < training.seq_length:
        raise PlanError(f"--max-position-embeddings ({model.max_position_embeddings}) is below --seq-length "
                        f"({training.seq_length}); the learned position table needs a row per position: raise it.")
    _validate_model(model, layout)
    _validate_pipeline(model, layout, training)
    _validate_training(model, layout, training)


def _validate_model(model: ModelSpec, layout: ParallelLayout) -> None:
    tp = layout.tp
    if model.kv_channels is None:
        _divides("--hidden-size", model.hidden_size, "--num-attention-heads", model.num_attention_heads,
                 "pass --kv-channels or pick sizes that divide")
    _divides("--num-attention-heads", model.num_attention_heads, "--num-query-groups", model.query_groups,
             "use a query-group count that divides the head count")
    _divides("--num-attention-heads", model.num_attention_heads, "--tensor-model-parallel-size", tp,
             "use a TP size that divides the head count")
    _divides("--num-query-groups", model.query_groups, "--tensor-model-parallel-size", tp,
             "use a TP size that divides the query-group count")
    if not model.num_experts:
        if layout.ep > 1:
            raise PlanError(f"--expert-model-parallel-size {layout.ep} needs a MoE model; add --num-experts "
                            "or drop the flag.")
        _divides("--ffn-hidden-size", model.ffn_hidden_size, "--tensor-model-parallel-size", tp,
                 "use a TP size that divides the FFN size")
        return
    _divides("--num-experts", model.num_experts, "--expert-model-parallel-size", layout.ep,
             "use an EP size that divides the expert count")
    if model.moe_router_topk > model.num_experts:
        raise PlanError(f"--moe-router-topk {model.moe_router_topk} exceeds --num-experts {model.num_experts}; "
                        "route to at most as many experts as there are.")
    _divides("--moe-ffn-hidden-size", model.moe_ffn, "--expert-tensor-parallel-size", layout.etp,
             "use an expert-TP size that divides the expert FFN size")
    if tp > 1 and not layout.sequence_parallel:
        raise PlanError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core "
                        "requires it); add --sequence-parallel.")
    freq = model.moe_layer_freq
    if isinstance(freq, tuple) and len(freq) != model.num_layers:
        raise PlanError(f"--moe-layer-freq lists {len(freq)} layers but --num-layers is {model.num_layers}; "
                        "give one 0/1 entry per layer.")
    if isinstance(freq, int) and freq < 1:
        raise PlanError(f"--moe-layer-freq must be at least 1, got {freq}; use 1 for a MoE block in every layer.")


def _validate_pipeline(model: ModelSpec, layout: ParallelLayout, training: TrainingSpec) -> None:
    pp, vpp, layers = layout.pp, layout.vpp, model.num_layers
    if layout.virtual_pipeline_model_parallel_size and pp == 1:
        raise PlanError("virtual pipeline stages need --pipeline-model-parallel-size > 1; raise PP or drop the "
                        "VPP flag.")
    first, last = layout.decoder_first_pipeline_num_layers, layout.decoder_last_pipeline_num_layers
    if first is None and last is None:
        _divides("--num-layers", layers, "PP x VPP", pp * vpp,
                 "pick PP/VPP sizes that divide it, or set --decoder-first-pipeline-num-layers / "
                 "--decoder-last-pipeline-num-layers")
    else:
        _validate_uneven(layers, pp, vpp, first, last)
    if vpp > 1:
        if training.num_microbatches < pp or training.num_microbatches % pp:
            raise PlanError(f"the interleaved schedule needs --num-microbatches ({training.num_microbatches}) to "
                            f"be a multiple of --pipeline-model-parallel-size ({pp}); change either.")


def _validate_uneven(layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> None:
    if pp == 1:
        raise PlanError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1; "
                        "drop them or raise PP.")
    ends = [n for n in (first, last) if n is not None]
    for n in ends:
        _positive("--decoder-first/last-pipeline-num-layers", n)
        _divides("the first/last stage's layer count", n, "VPP", vpp, "pick a multiple of the VPP size")
    middle_stages = pp - len(ends)
    middle = layers - sum(ends)
    uneven = middle_stages and (middle <= 0 or middle % (middle_stages * vpp))
    if middle < 0 or (middle_stages == 0 and middle) or uneven:
        raise PlanError(f"{layers} layers minus the first/last stage's {sum(ends)} do not split evenly over the "
                        f"other {middle_stages} stage(s) x VPP {vpp}; adjust the first/last stage layer counts.")


class _RunConfig:
    """The TransformerConfig fields that mcore_offload.config's recompute check reads, from the planner's specs."""

    def __init__(self, model: ModelSpec, layout: ParallelLayout, training: TrainingSpec) -> None:
        self.recompute_granularity = training.recompute_granularity
        self.recompute_method = training.recompute_method
        self.recompute_num_layers = training.recompute_num_layers
        self.num_layers = model.num_layers
        self.pipeline_model_parallel_size = layout.pp
        self.virtual_pipeline_model_parallel_size = layout.vpp
        self.num_layers_in_first_pipeline_stage = layout.decoder_first_pipeline_num_layers
        self.num_layers_in_last_pipeline_stage = layout.decoder_last_pipeline_num_layers


def _validate_training(model: ModelSpec, layout: ParallelLayout, training: TrainingSpec) -> None:
    if training.dtype not in DTYPE_BYTES:
        raise PlanError(f"Unknown dtype {training.dtype!r}: use bf16, fp16 or fp32.")
    if training.transformer_impl not in TRANSFORMER_IMPLS:
        raise PlanError(f"Unknown --transformer-impl {training.transformer_impl!r}: use transformer_engine or local.")
    _validate_fp8(model, training)
    if layout.sp:
        _divides("--seq-length", training.seq_length, "--tensor-model-parallel-size", layout.tp,
                 "with --sequence-parallel pick a sequence length TP divides")
    if training.recompute_granularity not in (None, "full", "selective"):
        raise PlanError(f"Unknown --recompute-granularity {training.recompute_granularity!r}: use full or "
                        "selective.")
    if training.recompute_method not in (None, "uniform", "block"):
        raise PlanError(f"Unknown --recompute-method {training.recompute_method!r}: use uniform or block.")
    layers = training.recompute_num_layers
    if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 1):
        raise PlanError(f"--recompute-num-layers must be a positive number of layers, got {layers!r}.")
    if training.full_recompute and (training.recompute_method is None or layers is None):
        raise PlanError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                        "--recompute-num-layers, as megatron-core does; add both.")
    unknown = [m for m in training.recompute_modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise PlanError(f"Unknown --recompute-modules {unknown}: choose from {', '.join(RECOMPUTE_MODULES)}.")
    if "mla_up_proj" in training.recomputed:
        raise PlanError("--recompute-modules mla_up_proj needs multi-latent attention, which the planner models "
                        "as standard attention; drop mla_up_proj.")
    try:
        validate_offload_modules(training.offload_modules)
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    # the same refusals as a real run's config validation (mcore_offload/config.py)
    if training.offload_modules and full_recompute_of_every_layer(_RunConfig(model, layout, training)):
        raise PlanError(full_recompute_message(training.recompute_method))
    for point, module in recompute_conflicts(training.recomputed).items():
        if point in training.offload_modules:
            raise PlanError(recompute_conflict_message(point, module))
    if attn_proj_alone_frees_nothing(training.offload_modules, training.recomputed, training.fp8):
        raise PlanError("--offload-modules has attn_proj without core_attn: core attention saves the same tensor, "
                        "so attn_proj alone frees nothing; add core_attn or drop attn_proj.")
    size = training.min_offloaded_tensor_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise PlanError(f"--min-offloaded-tensor-size must be a non-negative number of elements, got {size!r}; "
                        f"use 0 to offload everything or keep the default {DEFAULT_MIN_OFFLOADED_TENSOR_SIZE}.")


def _validate_fp8(model: ModelSpec, training: TrainingSpec) -> None:
    if training.fp8_recipe not in FP8_RECIPES:
        raise PlanError(f"Unknown --fp8-recipe {training.fp8_recipe!r}: use one of {', '.join(FP8_RECIPES)}.")
    if not training.fp8:
        return
    if training.fp8_format not in FP8_FORMATS:
        raise PlanError(f"Unknown --fp8-format {training.fp8_format!r}: use e4m3 or hybrid.")
    if not training.te:
        raise PlanError("--fp8-format needs the TE spec (--transformer-impl transformer_engine); megatron-core's "
                        "local spec has no FP8 path.")
    if training.dtype == "fp32":
        raise PlanError("--fp8-format runs inside 16-bit training, as in Megatron-LM; add --bf16 (or --fp16).")
    if training.fp8_recipe != "delayed":
        raise PlanError(f"--fp8-recipe {training.fp8_recipe} is not modelled: the planner knows delayed scaling "
                        "(per-tensor scales, measured on the GPU); plan with --fp8-recipe delayed for an estimate "
                        "without the recipe's block scales.")
    if "expert_fc1" in training.offload_modules and model.num_experts and training.moe_grouped_gemm:
        # the same refusal as mcore_offload/config.py (TE's grouped linear keeps Float8Tensor objects)
        raise PlanError("--offload-modules has expert_fc1, but with FP8 TransformerEngine's grouped GEMM saves the "
                        "experts' inputs as Float8Tensor objects, which are not offloaded; drop expert_fc1 (moe_act "
                        "still offloads) or plan without FP8.")
