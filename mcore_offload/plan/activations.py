"""Activation bytes of one transformer layer and one microbatch on one rank: what each offload point would
move, and what the layer keeps for backward without offloading.

Notation: ``T = seq_length * micro_batch_size`` tokens, ``h`` hidden, ``a`` heads, ``q = a * head_dim``,
``kv = query_groups * head_dim``, ``t`` TP, ``d = t`` with sequence parallelism else 1, ``f`` FFN size,
``g = 2`` for SwiGLU else 1. Sizes are elements; bytes are elements x dtype bytes unless a storage says fp32.

TE spec, flash/fused attention (per layer, per microbatch; dropout's masks at the end of the table):

=====================  ==================  ============================================================
saved tensor           elements            offload point
=====================  ==================  ============================================================
layer input            T*h/d               ``qkv_linear`` (LayerNormLinear keeps its input for the norm's
                                           backward); in the first layer of a model chunk it is the
                                           embedding output or the received pipeline activation, which
                                           is held elsewhere, so it stays there
attention norm output  T*h/d               ``qkv_linear`` (LayerNormLinear keeps it for its wgrad)
q, k, v                T*(q + 2kv)/t       ``core_attn`` (one storage, the fused QKV output)
softmax statistics     T*a/t (fp32)        ``core_attn`` (below the default minimum size: stays)
attention output       T*q/t               ``attn_proj`` (saved by core attention too: moves only
                                           when ``core_attn`` is offloaded as well)
dense: MLP input       T*h/d               none (fc1's LayerNormLinear, no point)
dense: MLP norm output T*h/d               none (fused into fc1)
dense: fc1 output      T*g*f/t             none;  activation output  T*f/t  none
MoE: MLP input         T*h/d               ``mlp_norm`` (the separate TENorm keeps its input)
MoE: norm output       T*h/d               none (the router's and dispatcher's input)
MoE: permuted tokens   R*h                 ``expert_fc1``,  R = T*topk/d*etp (balanced routing)
MoE: fc1 output        R*g*f_moe/etp       ``moe_act`` (with the permuted probabilities, R fp32)
MoE: act output        R*f_moe/etp         none (the fc2 input)
MoE: expert output     T*topk/d*h          none; only with --deterministic-mode and without
                                           --moe-permute-fusion (unpermute's index_add_ keeps its source)
RoPE cos and sin       4*s*head_dim        none; only with --no-rope-fusion (q's and k's, broadcast
                                           over the micro-batch)
rotated q and k        T*(q + kv)/t        none; only with core_attn recomputed (its checkpoint saves them
                                           and v, a view that keeps the whole q, k, v storage)
dropout masks          2*T*h/d bytes       none; only with --hidden-dropout > 0 (the two residual adds';
                                           one byte an element; the first stage keeps the embedding's
                                           too, planner.py); the local spec's attention dropout: below
=====================  ==================  ============================================================

FP8 (``--fp8-format``, delayed scaling, TE spec): the attention and MLP norm outputs, the projection's input (its
own copy of the attention output, which core attention alone then keeps in 16 bits and ``core_attn`` moves), fc2's
input and the experts' inputs are kept in FP8, one byte an element; ``expert_fc1`` is refused (the grouped linear
keeps a Float8Tensor object). Written after session 63's runs (benchmarks/results/issue5-session63).

The rows after "MoE: act output" were found by the allocator census and the predicted runs of
benchmarks/results/planner-census-session56 (config C: the expert output, 64 MiB a layer, is the 512 MiB between
the deterministic and the plain run's peak).

This is Korthikanti et al. 2022 (sbh(34 + 5as/h)) adapted: flash attention removes the s^2 terms, dropout
masks only as above, fused norms, a SwiGLU MLP keeps its fc1 output (2f) and activation output (f). The local spec
(unfused attention) adds the attention probabilities ``T*a*s/t`` to ``core_attn``, in bytes an element (16-bit
training): 2 with the fused softmax kernel, 5 with attention dropout too (its one-byte mask and the dropped
probabilities); 6 without the kernel (``--no-masked-softmax-fusion``: PyTorch's softmax keeps its fp32 output,
the context matmul the 16-bit cast), 7 with dropout (fp32 output, mask, dropped). Its separate norms keep
their inputs (``attn_norm``: the layer input, ``mlp_norm``: the MLP input), and its linears their inputs
(``qkv_linear``: the norm output). Local-spec bytes were checked on a GPU at TP = 1 and seq 2048
(benchmarks/results/planner-fused-paths-session57: exact); its peaks came out 1.7-5 % high. A norm recomputed with
``--recompute-modules layernorm`` still keeps its input (the checkpoint saves it) and discards its output; its
point is refused then (as is ``moe_act`` under moe_act recompute): offloading's hooks around a
``CheckpointWithoutOutput`` lose the checkpoint's input gradient. Local-spec attention also holds, from the
first step on, the global buffer its scores are computed into and (unfused softmax) a cached causal mask:
``workspace_bytes`` in planner.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mcore_offload.config import OFFLOAD_MODULES
from mcore_offload.plan.model import ModelSpec, ParallelLayout, TrainingSpec

FP32 = 4


@dataclass(frozen=True)
class Storage:
    """One tensor storage saved for backward."""

    name: str
    elements: int
    itemsize: int
    chunk_input: bool = False  # the layer input: held elsewhere in a model chunk's first layer
    # equal storages this entry stands for (a SequentialMLP's fc1 outputs, one per local expert): the size threshold
    # applies to each of them
    pieces: int = 1

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize

    @property
    def piece_elements(self) -> int:
        return self.elements // self.pieces


@dataclass(frozen=True)
class PointEstimate:
    """What offload point ``name`` would move for one layer and one microbatch; ``first_layer_bytes`` is
    what it moves in the first layer of a model chunk (whose input the embedding or the schedule holds)."""

    name: str
    storages: tuple[Storage, ...]
    offloaded_bytes: int
    note: str
    validated: bool
    first_layer_bytes: int = 0


@dataclass(frozen=True)
class LayerActivations:
    """One kind of layer (``dense`` or ``moe``): per-point estimates and the no-offload total."""

    kind: str
    points: Mapping[str, PointEstimate]
    saved: tuple[Storage, ...]
    notes: tuple[str, ...]
    #: Under full recompute: ``"input"`` (the layer starts a checkpoint and keeps only its input) or
    #: ``"inner"`` (a later layer of a checkpoint of several: keeps nothing); None: not recomputed.
    checkpoint: str | None = None
    #: What a checkpointed layer's recompute brings back in backward: the saved bytes of the same layer unrecomputed.
    recomputed_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved)

    def offloaded_bytes(self, modules: Iterable[str], first: bool = False) -> int:
        """Bytes that set ``modules`` moves off the device for this layer (points are additive); ``first``:
        the layer is the first of its model chunk."""
        return sum(self.point_bytes(m, first) for m in set(modules))

    def point_bytes(self, name: str, first: bool = False) -> int:
        point = self.points[name]
        return point.first_layer_bytes if first else point.offloaded_bytes


@dataclass
class _Builder:
    """Collects saved storages and point contents while one layer is described."""

    itemsize: int
    min_size: int
    saved: list[Storage]
    points: dict[str, PointEstimate]
    notes: list[str]

    def keep(self, name: str, elements: int, itemsize: int | None = None, chunk_input: bool = False,
             pieces: int = 1) -> Storage:
        storage = Storage(name, int(elements), itemsize or self.itemsize, chunk_input, max(1, pieces))
        self.saved.append(storage)
        return storage

    def point(self, name: str, storages: tuple[Storage, ...], note: str, validated: bool) -> None:
        moved = [s for s in storages if s.piece_elements >= self.min_size]
        small = [s.name for s in storages if s.piece_elements < self.min_size]
        if small and moved:
            note += f"; {', '.join(small)} below min_offloaded_tensor_size, kept"
        elif small:
            note = f"{note}; below min_offloaded_tensor_size ({self.min_size} elements): nothing moves"
        nbytes = sum(s.nbytes for s in moved)
        first = sum(s.nbytes for s in moved if not s.chunk_input)
        self.points[name] = PointEstimate(name, storages, nbytes, note, validated, first)

    def nothing(self, name: str, note: str, validated: bool = False) -> None:
        self.points[name] = PointEstimate(name, (), 0, note, validated)


def layer_activations(model: ModelSpec, layout: ParallelLayout, training: TrainingSpec,
                      moe: bool, checkpoint: str | None = None) -> LayerActivations:
    """Describe one layer; ``moe`` selects the MoE MLP block (else the dense MLP); ``checkpoint`` is the
    layer's role under full recompute (:meth:`TrainingSpec.checkpoint_role`), None for a layer without it."""
    b = _Builder(training.dtype_bytes, training.min_offloaded_tensor_size, [], {}, [])
    tokens = training.seq_length * training.micro_batch_size
    kind = "moe" if moe else "dense"
    if checkpoint is not None:
        if checkpoint not in ("input", "inner"):
            raise ValueError(f"unknown checkpoint role {checkpoint!r}: use 'input', 'inner' or None")
        # megatron-core's CheckpointFunction runs the layers under no_grad (no point opens) and saves only the
        # checkpoint's input; the recompute runs inside backward, where the runtime never offloads
        if checkpoint == "input":
            b.keep("layer input (full-recompute checkpoint)", tokens * model.hidden_size / layout.seq_shards,
                   chunk_input=True)
        what = ("its forward saves nothing but its input" if checkpoint == "input"
                else "inside a checkpoint of several layers, it saves nothing")
        for name in OFFLOAD_MODULES:
            b.nothing(name, f"full recompute: {what}")
        full = layer_activations(model, layout, training, moe).total_bytes
        return LayerActivations(kind, dict(b.points), tuple(b.saved), tuple(b.notes), checkpoint, full)
    _attention(b, model, layout, training, tokens)
    if moe:
        _moe_mlp(b, model, layout, training, tokens)
    else:
        _dense_mlp(b, model, layout, training, tokens)
        b.nothing("expert_fc1", "dense layer: no experts")
        b.nothing("moe_act", "dense layer: no experts")
    if training.hidden_dropout > 0:  # the two residual adds' dropouts, outside every offload point
        b.keep("hidden dropout masks (two, one byte an element)", 2 * tokens * model.hidden_size / layout.seq_shards,
               itemsize=1)
    points = {name: b.points[name] for name in OFFLOAD_MODULES}
    return LayerActivations(kind, points, tuple(b.saved), tuple(b.notes))


def _norm_point(b: _Builder, name: str, norm_input: Storage, te_fused: bool, what: str, validated: bool,
                recomputed: bool) -> None:
    """A separate norm keeps its input; a recomputed one keeps it inside its checkpoint, which offloading
    may not wrap (refused: see mcore_offload/config.py)."""
    if te_fused:
        b.nothing(name, "0 with the TE spec: the norm is fused into the next TE linear", validated=True)
    elif recomputed:
        b.nothing(name, "refused with layernorm recompute: its CheckpointWithoutOutput would lose the input "
                        "gradient under offloading's hooks")
    else:
        b.point(name, (norm_input,), what, validated)


def _attention(b: _Builder, model: ModelSpec, layout: ParallelLayout, training: TrainingSpec, tokens: int) -> None:
    t, d, te = layout.tp, layout.seq_shards, training.te
    recomputed = training.recomputed
    layer_in = b.keep("layer input (residual)", tokens * model.hidden_size / d, chunk_input=True)
    discard_norm = "layernorm" in recomputed and not te
    fp8 = training.fp8  # TE spec only (model.py): LayerNormLinear's norm output and a Linear's input in FP8
    norm_out = None if discard_norm else b.keep("attention norm output" + (" (FP8)" if fp8 else ""),
                                                tokens * model.hidden_size / d, itemsize=1 if fp8 else None)
    qkv = b.keep("q, k, v", tokens * (model.q_dim + 2 * model.kv_dim) / t)
    core_extra: tuple[Storage, ...] = ()
    if "core_attn" not in recomputed:
        if te:
            core_extra = (b.keep("softmax statistics (fp32)", tokens * model.num_attention_heads / t, FP32),)
        else:
            core_extra = _local_probabilities(b, training, tokens * model.num_attention_heads * training.seq_length / t)
    # FP8: the projection keeps an FP8 copy of the attention output, so core attention alone holds the 16-bit one
    # (benchmarks/results/issue5-session63: core_attn 64 MiB a layer where 48 were moved in 16-bit runs), and none
    # does when core attention is recomputed
    out = None if fp8 and "core_attn" in recomputed else b.keep("attention output", tokens * model.q_dim / t)
    proj_in = b.keep("attention output in FP8 (the projection's input)", tokens * model.q_dim / t, 1) if fp8 else out
    if "core_attn" in recomputed:
        # The checkpoint saves its inputs: RoPE's fresh q and k, and v, a view that keeps the whole QKV output
        # (benchmarks/results/planner-census-session56, E4: 80 MiB a layer where 48 were counted).
        b.keep("rotated q and k (the core-attention checkpoint's inputs)", tokens * (model.q_dim + model.kv_dim) / t)
    if model.rope and not training.rope_fusion:  # unfused RoPE multiplies q and k by fresh cos and sin tensors
        b.keep("RoPE cos and sin (unfused)", 4 * training.seq_length * model.head_dim)

    # TP=1: the TE spec in benchmarks/results/issue4-* (tests/test_plan_validation.py), the local spec's dense
    # points in planner-fused-paths-session57 (bytes exact; tests/test_plan_measurements.py)
    measured = t == 1
    held = "; held elsewhere in a chunk's first layer"
    _norm_point(b, "attn_norm", layer_in, te, "the norm's saved input (the layer input" + held + ")", measured,
                "layernorm" in recomputed)
    shard = " (local sequence shard)" if layout.sp else ""
    if te and norm_out is not None:
        b.point("qkv_linear", (norm_out, layer_in),
                "LayerNormLinear's saved norm output and input (the layer input" + held + ")" + shard, measured)
    elif norm_out is None:
        b.nothing("qkv_linear", "recompute layernorm: the linear's saved norm output is discarded")
    else:
        b.point("qkv_linear", (norm_out,), "the QKV linear's saved input (the norm output)" + shard, False)
    if "core_attn" in recomputed:
        b.nothing("core_attn", "recompute core_attn: the checkpointed branch has no offload point; q, k, v stay "
                               "saved by the checkpoint")
        b.notes.append("core_attn is recomputed: offloading core_attn moves nothing")
    else:
        kind = "flash/fused attention" if te else "unfused attention, with the s^2 probabilities"
        if fp8:  # core attention is not recomputed here, so it keeps the 16-bit output
            b.point("core_attn", (qkv, out, *core_extra), f"q, k, v and the attention output ({kind}; FP8: the "
                                                          "projection keeps its own copy)", measured)
        else:
            b.point("core_attn", (qkv, *core_extra), f"q, k, v ({kind})", measured)
    note = "attention output (moves only with core_attn)"
    if fp8:
        note = "the projection's FP8 copy of the attention output (its own storage)"
    elif "core_attn" in recomputed:
        note = "attention output, held only by the projection since core attention is recomputed"
    b.point("attn_proj", (proj_in,), note, measured and "core_attn" not in recomputed)


def _local_probabilities(b: _Builder, training: TrainingSpec, elements: float) -> tuple[Storage, ...]:
    """What megatron-core's local DotProductAttention keeps of its s^2 probabilities (``elements``) a layer."""
    # Without the fused kernel, FusedScaleMaskSoftmax's PyTorch path softmaxes a fp32 copy of 16-bit scores
    # (attention_softmax_in_fp32) and nn.Softmax keeps that fp32 output for its backward.
    fp32_softmax = training.dtype_bytes == 2 and not training.masked_softmax_fusion
    kept = (b.keep("attention probabilities in fp32 (PyTorch softmax's output)", elements, FP32),) \
        if fp32_softmax else ()
    if training.attention_dropout > 0:
        # dropout keeps its mask; the context matmul keeps the dropped probabilities, not the softmax's output
        kept += (b.keep("attention dropout mask (one byte an element)", elements, itemsize=1),
                 b.keep("dropped attention probabilities (the context matmul's input)", elements))
        if not fp32_softmax:  # the fused kernel (or a 32-bit softmax) keeps its own output
            kept += (b.keep("attention probabilities (the softmax's output)", elements),)
    else:  # the softmax's output (or its 16-bit cast) is the context matmul's input
        kept += (b.keep("attention probabilities", elements),)
    return kept


def _dense_mlp(b: _Builder, model: ModelSpec, layout: ParallelLayout, training: TrainingSpec, tokens: int) -> None:
    t, d, te = layout.tp, layout.seq_shards, training.te
    hidden = tokens * model.hidden_size / d
    gate = 2 if model.swiglu else 1
    recomputed = training.recomputed
    fp8 = training.fp8
    mlp_in = b.keep("MLP input (residual)", hidden)
    if not (te and "mlp" in recomputed) and not ("layernorm" in recomputed and not te):
        # TE keeps the norm output inside LayerNormLinear; a recomputed MLP's checkpoint keeps it as its input.
        b.keep("MLP norm output" + (" (FP8)" if fp8 else ""), hidden, itemsize=1 if fp8 else None)
    if "mlp" in recomputed:
        b.notes.append("mlp is recomputed: the dense MLP keeps only its input")
    else:
        b.keep("fc1 output", tokens * gate * model.ffn_hidden_size / t)
        b.keep("activation output" + (" in FP8 (fc2's input)" if fp8 else ""), tokens * model.ffn_hidden_size / t,
               itemsize=1 if fp8 else None)
    _norm_point(b, "mlp_norm", mlp_in, te, "the norm's saved input (the MLP input)", not te and layout.tp == 1,
                "layernorm" in recomputed)


def routed_rows(model: ModelSpec, layout: ParallelLayout, training: TrainingSpec) -> int:
    """Expected rows in a rank's permuted-token tensor: its sequence shard's tokens x top-k, received through a
    balanced all-to-all (every EP rank gets as many rows as it sends), all-gathered over expert-TP."""
    tokens = training.seq_length * training.micro_batch_size
    return tokens * model.moe_router_topk * layout.etp // layout.seq_shards


def _moe_mlp(b: _Builder, model: ModelSpec, layout: ParallelLayout, training: TrainingSpec, tokens: int) -> None:
    t, d, etp, te = layout.tp, layout.seq_shards, layout.etp, training.te
    recomputed = training.recomputed
    gate = 2 if model.swiglu else 1
    hidden = tokens * model.hidden_size / d
    mlp_in = b.keep("MLP input (residual)", hidden)
    if "layernorm" not in recomputed:
        b.keep("MLP norm output (router input)", hidden)
    what = "TENorm's saved input (the MLP input; the norm is not fused in a MoE layer)" if te else \
        "the norm's saved input (the MLP input)"
    _norm_point(b, "mlp_norm", mlp_in, False, what, te and layout.tp == 1, "layernorm" in recomputed)
    if "moe" in recomputed:
        b.nothing("expert_fc1", "recompute moe: the MoE layer is checkpointed, nothing is saved inside")
        b.nothing("moe_act", "recompute moe: the MoE layer is checkpointed, nothing is saved inside")
        b.notes.append("moe is recomputed: expert_fc1 and moe_act move nothing")
        return
    rows = routed_rows(model, layout, training)
    fp8 = training.fp8  # the grouped linears keep their inputs in FP8 (Float8Tensor objects, not offloaded)
    byte = 1 if fp8 else None
    b.keep("router logits and probabilities (fp32)", 2 * tokens * model.num_experts / d, FP32)
    # A SequentialMLP runs one MLP per local expert: the permuted tokens stay one storage (each expert's input is a
    # split of it), but each expert's fc1 output is a storage of its own, and min_offloaded_tensor_size applies to
    # each. Balanced routing gives every local expert rows / local experts rows. Under FP8 each expert's TE linear
    # quantizes its own input, so the FP8 inputs are one storage per expert too.
    local_experts = 1 if training.moe_grouped_gemm else max(1, model.num_experts // layout.ep)
    sequential_fp8 = fp8 and local_experts > 1
    permuted = b.keep("permuted tokens" + (f" in FP8 (one storage per expert, {local_experts})" if sequential_fp8
                                           else " in FP8" if fp8 else ""),
                      rows * model.hidden_size, byte, pieces=local_experts if sequential_fp8 else 1)
    fc1 = b.keep("expert fc1 output" + ("" if local_experts == 1 else f"s (one storage per expert, {local_experts})"),
                 rows * gate * model.moe_ffn / etp, pieces=local_experts)
    probs = b.keep("permuted probabilities (fp32)", rows, FP32)
    measured = te and t == 1 and etp == 1 and layout.ep == 1
    if fp8 and training.moe_grouped_gemm:
        b.nothing("expert_fc1", "refused with FP8: TE's grouped linear keeps its input as a Float8Tensor object, "
                                "which the runtime does not offload")
    elif sequential_fp8:  # TE's Linear saves its FP8 input as plain tensors, as the dense projections do
        least = -(-training.min_offloaded_tensor_size // model.hidden_size)
        b.point("expert_fc1", (permuted,), "each expert's input in FP8, quantized by its own TE linear (balanced "
                f"routing, rows padded to a multiple of 16; an expert routed fewer than {least} rows keeps its "
                "own)", False)
    else:
        b.point("expert_fc1", (permuted,), "permuted tokens (balanced routing)", measured)
    if "moe_act" in recomputed:
        b.nothing("moe_act", "refused with moe_act recompute: its CheckpointWithoutOutput (which keeps fc1's "
                             "output) would lose the input gradient under offloading's hooks")
        b.notes.append("moe_act is recomputed: the moe_act point is refused; fc1's output stays on the device")
    else:
        b.keep("expert activation output" + (" in FP8 (fc2's input)" if fp8 else ""), rows * model.moe_ffn / etp, byte)
        what = "expert fc1 output (the SwiGLU input)" if gate == 2 else "expert fc1 output (the activation input)"
        if fp8:  # FP8 grouped GEMMs pad each expert's rows to a multiple of 16 (0.7 % more in session 63's C run)
            what += "; FP8 pads each expert's rows a little"
        if local_experts > 1:
            least = -(-training.min_offloaded_tensor_size * etp // (gate * model.moe_ffn))
            what += f"; SequentialMLP: one storage an expert, {fc1.piece_elements} elements under balanced routing"
            if fc1.piece_elements >= training.min_offloaded_tensor_size:
                what += f" (an expert routed fewer than {least} rows keeps its own: an upper bound)"
            else:  # uneven routing still lifts the busiest experts over it (session 81: 41 MiB a step, not 0)
                what += (f": none moves if routing is balanced, but an expert routed {least} rows or more moves its "
                         "own (a lower bound); --moe-grouped-gemm, or a min_offloaded_tensor_size under one "
                         "expert's output, moves them all")
        b.point("moe_act", (fc1, probs), what, measured and training.moe_grouped_gemm)
    if training.deterministic and not training.moe_permute_fusion:
        b.keep("expert output (unpermute's index_add_ source)", tokens * model.moe_router_topk // d * model.hidden_size)
    if model.moe_shared_expert_intermediate_size and "shared_experts" not in recomputed:
        shared = model.moe_shared_expert_intermediate_size
        b.keep("shared expert fc1 output", tokens * gate * shared / t)
        b.keep("shared expert activation output" + (" in FP8" if fp8 else ""), tokens * shared / t, byte)


def summarize(layers: Mapping[str, LayerActivations]) -> dict[str, int]:
    """Per point, the largest offloadable bytes over the layer kinds (for listing the points that apply)."""
    return {name: max(acts.points[name].offloaded_bytes for acts in layers.values()) for name in OFFLOAD_MODULES}

