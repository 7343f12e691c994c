"""What the planner is told: the model, the parallel layout and the training settings, plus model presets.

Field names follow Megatron-LM's command line (``--num-query-groups`` is ``num_query_groups``) so that a
launch script's flags carry over. Whether they fit together is ``validate.py``'s question; its
:func:`~mcore_offload.plan.validate.validate` raises :class:`PlanError` with one sentence that names what is wrong and
what to do.
"""

from __future__ import annotations

import ast
import types
from collections.abc import Mapping
from dataclasses import dataclass, replace

from mcore_offload.config import DEFAULT_MIN_OFFLOADED_TENSOR_SIZE, OFFLOAD_MODULES

#: megatron-core 0.15's selective-recompute module names.
RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                                      "shared_experts")
DTYPE_BYTES: Mapping[str, int] = types.MappingProxyType({"bf16": 2, "fp16": 2, "fp32": 4})
TRANSFORMER_IMPLS: tuple[str, ...] = ("transformer_engine", "local")
FP8_FORMATS: tuple[str, ...] = ("e4m3", "hybrid")
#: Megatron-LM's --fp8-recipe values; the planner models delayed scaling only (per-tensor scales, measured on the GPU)
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "mxfp8", "blockwise")
#: Megatron-LM's --position-embedding-type values the planner models (learned_absolute adds a weight table)
POSITION_EMBEDDING_TYPES: tuple[str, ...] = ("rope", "learned_absolute", "none")


class PlanError(ValueError):
    """The planner's input is inconsistent; the message says what to change."""


@dataclass(frozen=True)
class ModelSpec:
    """The architecture (Megatron-LM flag names). ``moe_layer_freq``: 1 = every layer is MoE, k = every k-th
    layer, or one 0/1 per layer (Megatron-LM's ``--moe-layer-freq "([0]*3+[1]*58)"``)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    vocab_size: int = 32000
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    # RoPE, as every preset; Megatron-LM's own default is learned_absolute (its table is max positions x hidden)
    position_embedding_type: str = "rope"
    max_position_embeddings: int | None = None  # learned_absolute only; default the sequence length
    name: str = "custom"

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.query_groups * self.head_dim

    @property
    def rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: is it a MoE layer."""
        if not self.num_experts:
            return (False,) * self.num_layers
        if isinstance(self.moe_layer_freq, int):
            return tuple(i % self.moe_layer_freq == 0 for i in range(self.num_layers))
        return tuple(bool(x) for x in self.moe_layer_freq)


@dataclass(frozen=True)
class ParallelLayout:
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def vpp(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def sp(self) -> bool:
        # Megatron-LM turns sequence parallelism off when TP is 1.
        return self.sequence_parallel and self.tensor_model_parallel_size > 1

    @property
    def seq_shards(self) -> int:
        """Factor by which sequence parallelism shards the hidden-sized tensors outside attention/MLP."""
        return self.tensor_model_parallel_size if self.sp else 1


@dataclass(frozen=True)
class TrainingSpec:
    seq_length: int = 4096
    micro_batch_size: int = 1
    num_microbatches: int = 1
    dtype: str = "fp32"
    transformer_impl: str = "transformer_engine"
    recompute_granularity: str | None = None
    recompute_modules: tuple[str, ...] = ()
    # full recompute: "uniform" checkpoints every layer in units of recompute_num_layers, "block" only the first
    # recompute_num_layers layers of each model chunk (megatron-core's TransformerBlock._checkpointed_forward)
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    offload_modules: tuple[str, ...] = ()
    min_offloaded_tensor_size: int = DEFAULT_MIN_OFFLOADED_TENSOR_SIZE
    # Megatron-LM's --deterministic-mode: megatron-core's unfused MoE unpermute then adds with index_add_, whose
    # backward keeps its whole source (scatter_add_ keeps only the indices)
    deterministic: bool = False
    moe_permute_fusion: bool = False  # --moe-permute-fusion: TE's fused (un)permute, which keeps no such source
    # --moe-grouped-gemm: the experts as one grouped GEMM (one fc1 output for all local experts, and TE's
    # multi-stream workspaces); without it Megatron-LM builds a SequentialMLP, one fc1 output per local expert
    moe_grouped_gemm: bool = True
    rope_fusion: bool = True  # --no-rope-fusion: unfused RoPE keeps its cos and sin for q and k in every layer
    # --no-masked-softmax-fusion: the local spec's attention then softmaxes in PyTorch, in fp32 for 16-bit training,
    # and keeps those fp32 probabilities too
    masked_softmax_fusion: bool = True
    # --hidden-dropout / --attention-dropout (the CLI takes Megatron-LM's 0.1 without a preset): a dropout keeps a
    # one-byte mask of what it drops; TE's flash/fused attention keeps its RNG state instead
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # --fp8-format / --fp8-recipe: TE's FP8 GEMMs; a linear then keeps its input in FP8 (one byte an element) and
    # every linear weight an FP8 copy and its transpose (activations.py, planner.py)
    fp8_format: str | None = None
    fp8_recipe: str = "delayed"

    @property
    def fp8(self) -> bool:
        return self.fp8_format is not None

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def te(self) -> bool:
        return self.transformer_impl == "transformer_engine"

    @property
    def recomputed(self) -> frozenset[str]:
        """The selective-recompute modules in force (megatron-core's default is ``core_attn``)."""
        if self.recompute_granularity != "selective":
            return frozenset()
        return frozenset(self.recompute_modules or ("core_attn",))

    @property
    def full_recompute(self) -> bool:
        return self.recompute_granularity == "full"

    def checkpoint_role(self, index: int) -> str | None:
        """Under full recompute, what the ``index``-th layer of a model chunk keeps: ``"input"`` (it starts a
        checkpoint, which saves its input), ``"inner"`` (a later layer of a uniform checkpoint: nothing), or None
        (it runs without recompute). Without a method, every layer is its own checkpoint (uniform, 1)."""
        if not self.full_recompute:
            return None
        n = self.recompute_num_layers or 1
        if self.recompute_method == "block":
            return "input" if index < n else None
        return "input" if index % n == 0 else "inner"


# Public architecture numbers (model cards / HF configs). All five train in bf16 with SwiGLU and untied
# output weights; presets set those too. Sequence length, batch and layout come from the command line.
_PRESETS: Mapping[str, ModelSpec] = types.MappingProxyType({
    "llama3-8b": ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                           ffn_hidden_size=14336, vocab_size=128256, swiglu=True,
                           untie_embeddings_and_output_weights=True, name="llama3-8b"),
    "llama3-70b": ModelSpec(num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                            ffn_hidden_size=28672, vocab_size=128256, swiglu=True,
                            untie_embeddings_and_output_weights=True, name="llama3-70b"),
    # head_dim 128 with 32 heads: the query width (4096) is twice the hidden size.
    "qwen3-30b-a3b": ModelSpec(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                               kv_channels=128, ffn_hidden_size=6144, vocab_size=151936, swiglu=True,
                               untie_embeddings_and_output_weights=True, num_experts=128, moe_router_topk=8,
                               moe_ffn_hidden_size=768, name="qwen3-30b-a3b"),
    "mixtral-8x7b": ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                              ffn_hidden_size=14336, vocab_size=32000, swiglu=True,
                              untie_embeddings_and_output_weights=True, num_experts=8, moe_router_topk=2,
                              moe_ffn_hidden_size=14336, name="mixtral-8x7b"),
    # Multi-latent attention is approximated by standard multi-head attention with the same 128 heads and
    # head_dim 128 (MLA's value head size; its q/k heads are 192 wide, so q/k bytes are ~1/3 low). The first
    # three layers are dense (ffn 18432); one shared expert of 2048; multi-token prediction is not modelled.
    "deepseek-v3": ModelSpec(num_layers=61, hidden_size=7168, num_attention_heads=128, kv_channels=128,
                             ffn_hidden_size=18432, vocab_size=129280, swiglu=True,
                             untie_embeddings_and_output_weights=True, num_experts=256, moe_router_topk=8,
                             moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
                             moe_layer_freq=(0,) * 3 + (1,) * 58, name="deepseek-v3"),
})


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def get_preset(name: str) -> ModelSpec:
    """The preset ``name``; :class:`PlanError` for an unknown one."""
    try:
        return _PRESETS[name]
    except KeyError:
        raise PlanError(f"Unknown preset {name!r}: choose one of {', '.join(_PRESETS)}, "
                        "or describe the model with --num-layers, --hidden-size, ... instead.") from None


def with_overrides(spec: ModelSpec, **overrides: object) -> ModelSpec:
    """``spec`` with the given fields replaced; ``None`` values leave a field as it is."""
    return replace(spec, **{k: v for k, v in overrides.items() if v is not None})


def parse_moe_layer_freq(text: str | int) -> int | tuple[int, ...]:
    """Megatron-LM's ``--moe-layer-freq``: an int, or a list expression such as ``([0]*3+[1]*58)``.

    Evaluated on the syntax tree (lists of 0/1, ``*`` by an int, ``+``), never with ``eval``.
    """
    if isinstance(text, int):
        return text
    try:
        return int(text)
    except ValueError:
        pass

    def value(node: ast.AST) -> list[int] | int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [_as_int(value(e)) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mult):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
                return left + right
            if isinstance(node.op, ast.Mult) and isinstance(left, list) and isinstance(right, int):
                return left * right
        raise PlanError(f"--moe-layer-freq {text!r} is not an int or a list expression like '([0]*3+[1]*58)'; "
                        "write it in that form.")

    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise PlanError(f"--moe-layer-freq {text!r} is not an int or a list expression like '([0]*3+[1]*58)'; "
                        "write it in that form.") from None
    result = value(tree.body)
    if not isinstance(result, list) or any(x not in (0, 1) for x in result):
        raise PlanError(f"--moe-layer-freq {text!r} must give one 0 or 1 per layer; write e.g. '([0]*3+[1]*58)'.")
    return tuple(result)


def _as_int(v: list[int] | int) -> int:
    if not isinstance(v, int):
        raise PlanError("--moe-layer-freq lists hold plain 0/1 entries; write e.g. '([0]*3+[1]*58)'.")
    return v


__all__ = [
    "DTYPE_BYTES",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "OFFLOAD_MODULES",
    "RECOMPUTE_MODULES",
    "ModelSpec",
    "ParallelLayout",
    "PlanError",
    "TrainingSpec",
    "get_preset",
    "parse_moe_layer_freq",
    "preset_names",
    "with_overrides",
]
