"""Put the pieces together: per rank and offload set, the projected peak; the recommended set.

Projected peak of rank ``r`` with set ``S`` (bytes)::

    static    = parameters on the rank x 2 x dtype bytes          (weights + grads, no optimizer state)
                + workspaces                                      (cuBLAS workspaces, RoPE's frequency cache)
    logits    = T * V_padded / t * (dtype bytes + 4)              (last stage: logits and the fp32 copy
                + 2 * T * h / d * dtype bytes                      the cross entropy makes; the final norm's
                                                                   saved input and output)
    act(none) = the largest candidate instant of the rank's schedule: the in-flight chunk forwards' saved
                bytes plus the logits (forward end) or the first backward layer's working set
    act(S)    = the largest instant less what S has off the device at it

:mod:`mcore_offload.plan.peak` holds the instants and what the runtime has off the device at each.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace

from mcore_offload.config import OFFLOAD_MODULES, attn_proj_frees_alone, recompute_conflicts
from mcore_offload.plan.activations import LayerActivations, layer_activations, summarize
from mcore_offload.plan.hardware import (
    Hardware,
    TransferTiming,
    forward_seconds,
    layer_forward_flops,
    transfer_timing,
)
from mcore_offload.plan.model import ModelSpec, ParallelLayout, PlanError, TrainingSpec
from mcore_offload.plan.peak import ChunkLayers, RankTimeline, chunk_layers, rank_timeline
from mcore_offload.plan.recommend import (
    MAX_EXPOSED,
    LayerCost,
    RankDemand,
    Recommendation,
    freed_bytes,
    recommend,
)
from mcore_offload.plan.schedule import PeakLayers, layer_assignment, peak_layers, schedule_name
from mcore_offload.plan.validate import validate

logger = logging.getLogger(__name__)

GIB = 2**30
MIB = 2**20
#: One cuBLAS workspace on sm90+ GPUs (every GPU in plan.hardware). A process takes them once from PyTorch's caching
#: allocator: PyTorch one per (handle, stream), of which training uses two (the forward's thread and autograd's
#: backward thread); TE one for its GEMMs; TE's grouped-GEMM experts four more (its multi-stream GEMMs; not with
#: SequentialMLP experts). Measured by the allocator census of benchmarks/results/planner-census-session56: 96 MiB on
#: config A, 224 MiB on config C; C's model with SequentialMLP experts (session 80) peaked 128 MiB under the grouped
#: projection without offloading.
CUBLAS_WORKSPACE_BYTES = 32 * MIB
TE_GROUPED_GEMM_STREAMS = 4
ATTENTION_SET = ("qkv_linear", "core_attn", "attn_proj")
MOE_SET = ("expert_fc1", "moe_act")


#: Kind-name suffix of a layer under full recompute (its checkpoint role): it keeps its input, or nothing.
_ROLE_SUFFIX = {None: "", "input": " rc", "inner": " rc+"}


def _kind_order(kind: str) -> tuple[bool, str]:
    """Layers without recompute first (the report's first column), then by name."""
    return (kind.endswith(("rc", "rc+")), kind)


@dataclass(frozen=True)
class PlanConfig:
    """Everything the planner needs; ``memory_target_gib`` is per rank, against the projected total."""

    model: ModelSpec
    layout: ParallelLayout
    training: TrainingSpec
    hardware: Hardware
    memory_target_gib: float | None = None
    max_exposed: float = MAX_EXPOSED


@dataclass(frozen=True)
class OffloadSet:
    label: str
    modules: tuple[str, ...]
    bytes_per_layer: Mapping[str, int]  # layer kind -> bytes one layer offloads per microbatch
    timing: Mapping[str, TransferTiming]  # layer kind -> transfer against compute
    exposed_fraction: float
    hidden: bool


@dataclass(frozen=True)
class ChunkPlan:
    chunk: int
    layers: range
    kinds: Mapping[str, int]
    in_flight: int  # forwards of this chunk held at the peak


@dataclass(frozen=True)
class RankPlan:
    rank: int
    chunks: tuple[ChunkPlan, ...]
    peak: PeakLayers
    offloaded_layers: Mapping[str, int]  # layer kind -> layers whose groups are off the device at the peak
    static_bytes: int  # weights, grads and workspace_bytes
    logits_bytes: int
    activation_bytes: Mapping[str, int]  # set label -> projected activation peak (incl. logits)
    peak_instants: Mapping[str, str]  # set label -> the instant that holds the peak

    def total_bytes(self, label: str) -> int:
        return self.static_bytes + self.activation_bytes[label]


@dataclass(frozen=True)
class Plan:
    config: PlanConfig
    schedule: str
    layers: Mapping[str, LayerActivations]
    forward_seconds: Mapping[str, float]
    sets: tuple[OffloadSet, ...]
    ranks: tuple[RankPlan, ...]
    recommendation: Recommendation
    warnings: tuple[str, ...]
    timelines: tuple[RankTimeline, ...] = ()

    def delta_peak(self, modules: tuple[str, ...] | list[str]) -> tuple[int, ...]:
        """Per rank, how much offloading ``modules`` lowers the projected peak (any set, bytes)."""
        return tuple(t.delta_peak(modules) for t in self.timelines)

    def offloaded_per_step(self, modules: tuple[str, ...] | list[str]) -> tuple[dict[str, int], ...]:
        """Per rank and point, the bytes ``modules`` copies to the host in one training step."""
        return tuple(t.offloaded_per_step(modules) for t in self.timelines)


def padded_vocab(model: ModelSpec, layout: ParallelLayout) -> int:
    """Megatron-LM pads the vocabulary to a multiple of 128 x TP."""
    unit = 128 * layout.tp
    return -(-model.vocab_size // unit) * unit


def layer_params(model: ModelSpec, layout: ParallelLayout, moe: bool) -> int:
    """Parameters of one layer on one rank."""
    t, h = layout.tp, model.hidden_size
    mats = 3 if model.swiglu else 2
    params = h * (model.q_dim + 2 * model.kv_dim) // t + model.q_dim * h // t + 2 * h
    if not moe:
        return params + h * model.ffn_hidden_size * mats // t
    experts = (model.num_experts or 0) // layout.ep
    params += experts * h * model.moe_ffn * mats // layout.etp + h * (model.num_experts or 0)
    if model.moe_shared_expert_intermediate_size:
        params += h * model.moe_shared_expert_intermediate_size * mats // t
    return params


def _static_bytes(config: PlanConfig, rank: int, chunks: tuple[range, ...], moe_layers: tuple[bool, ...]) -> int:
    model, layout = config.model, config.layout
    kinds = [moe_layers[i] for c in chunks for i in c]  # the rank's layers, MoE or dense
    params = sum(layer_params(model, layout, moe) for moe in kinds)
    embedding = padded_vocab(model, layout) * model.hidden_size // layout.tp
    if rank == 0:
        params += embedding
        if model.position_embedding_type == "learned_absolute":
            params += (model.max_position_embeddings or config.training.seq_length) * model.hidden_size
    if rank == layout.pp - 1:
        # Tied weights still need a copy of the embedding on the last stage when PP > 1.
        params += model.hidden_size + (embedding if model.untie_embeddings_and_output_weights or layout.pp > 1
                                       else 0)
    fp8_copies = 2 * sum(linear_weights(model, layout, moe) for moe in kinds) if config.training.fp8 else 0
    return params * 2 * config.training.dtype_bytes + fp8_copies + workspace_bytes(config, any(kinds))


def linear_weights(model: ModelSpec, layout: ParallelLayout, moe: bool) -> int:
    """Elements of one layer's linear weights on one rank (:func:`layer_params` less the norms and the router).
    Under FP8 TE keeps an FP8 copy of each and its transpose from the step's first microbatch on: 2 bytes an element
    (the offload audit's workspace bytes in benchmarks/results/issue5-session63: 512 MiB on A at 4 layers, 896 MiB
    on C, exact)."""
    params = layer_params(model, layout, moe) - 2 * model.hidden_size
    return params - model.hidden_size * (model.num_experts or 0) if moe else params


def workspace_bytes(config: PlanConfig, has_moe: bool) -> int:
    """What a rank holds besides weights and grads from its first step on: cuBLAS workspaces
    (:data:`CUBLAS_WORKSPACE_BYTES`) and, with RoPE, its cached fp32 frequencies (seq x head_dim); with the
    local spec, the global buffer its attention scores are computed into (micro-batch x heads/TP x seq^2) and,
    without the fused softmax, the cached causal mask (seq^2 bools)."""
    training, model, layout = config.training, config.model, config.layout
    grouped = has_moe and training.moe_grouped_gemm
    workspaces = 2 + (1 + (TE_GROUPED_GEMM_STREAMS if grouped else 0) if training.te else 0)
    total = workspaces * CUBLAS_WORKSPACE_BYTES + (training.seq_length * model.head_dim * 4 if model.rope else 0)
    if not training.te:
        seq_squared = training.seq_length ** 2
        total += training.micro_batch_size * model.num_attention_heads // layout.tp * seq_squared \
            * training.dtype_bytes + (0 if training.masked_softmax_fusion else seq_squared)
    return total


def _offload_sets(layers: Mapping[str, LayerActivations], training: TrainingSpec,
                  rec: Recommendation) -> list[tuple[str, tuple[str, ...]]]:
    """(label, modules): none, each useful point alone, the attention and MoE sets, all, requested, recommended."""
    useful = [m for m, nbytes in summarize(layers).items() if nbytes > 0]
    sets: list[tuple[str, tuple[str, ...]]] = [("none", ())]
    alone = attn_proj_frees_alone(training.recomputed, training.fp8)
    for m in useful:  # attn_proj alone only where it frees memory alone (FP8, core_attn recompute)
        paired = m == "attn_proj" and not alone
        sets.append(("core_attn+attn_proj", ("core_attn", "attn_proj")) if paired else (m, (m,)))
    refused = recompute_conflicts(training.recomputed)  # a run refuses these points: no set shown may hold them
    for label, fixed in (("attention", ATTENTION_SET), ("moe", MOE_SET)):
        if any(m in useful for m in fixed):
            sets.append((label, tuple(m for m in fixed if m not in refused)))
    everything = tuple(m for m in OFFLOAD_MODULES if m in useful
                       or (m == "core_attn" and "attn_proj" in useful and not alone))
    if everything:
        sets.append(("all", everything))
    merged: dict[tuple[str, ...], str] = {}
    for label, modules in sets:
        key = tuple(m for m in OFFLOAD_MODULES if m in modules)
        merged[key] = f"{merged[key]}/{label}" if key in merged else label
    out = [(label, modules) for modules, label in merged.items()]
    if training.offload_modules:
        out.append(("requested", tuple(m for m in OFFLOAD_MODULES if m in training.offload_modules)))
    out.append(("recommended", rec.modules))
    return out


def build_plan(config: PlanConfig) -> Plan:
    """Validate ``config`` and project every rank's peak for every offload set."""
    model, layout, training, hw = config.model, config.layout, config.training, config.hardware
    validate(model, layout, training)
    if config.memory_target_gib is not None and not config.memory_target_gib > 0:
        raise PlanError(f"--memory-target-gib must be a positive number, got {config.memory_target_gib!r}; "
                        "pass the per-rank budget in GiB.")
    moe_layers = model.moe_layers()
    assignment = layer_assignment(model.num_layers, layout)
    # a layer's kind: its MLP block, and under full recompute its place in a checkpoint (block recompute
    # checkpoints the first layers of every chunk, so the role follows the layer's index in its chunk)
    roles = {i: training.checkpoint_role(j) for chunks in assignment for rng in chunks for j, i in enumerate(rng)}
    kind_of = {i: ("moe" if moe_layers[i] else "dense") + _ROLE_SUFFIX[roles[i]] for i in range(model.num_layers)}
    specs = {kind_of[i]: (moe_layers[i], roles[i]) for i in range(model.num_layers)}
    layers = {k: layer_activations(model, layout, training, moe=specs[k][0], checkpoint=specs[k][1])
              for k in sorted(specs, key=_kind_order)}
    fwd = {k: forward_seconds(layer_forward_flops(model, layout, training, specs[k][0]), hw, training.dtype)
           for k in layers}
    costs = {k: LayerCost({m: acts.points[m].offloaded_bytes for m in OFFLOAD_MODULES}, fwd[k])
             for k, acts in layers.items()}

    peaks = [peak_layers(chunks, layout.pp, r, training.num_microbatches) for r, chunks in enumerate(assignment)]
    offloaded = []
    for peak in peaks:
        count = Counter(kind_of[layer] for layer in peak.resident)
        count[kind_of[peak.turning_layer]] -= 1
        offloaded.append(dict(count))
    statics = [_static_bytes(config, r, chunks, moe_layers) for r, chunks in enumerate(assignment)]
    vocab = padded_vocab(model, layout)
    tokens = training.seq_length * training.micro_batch_size
    last = layout.pp - 1
    # the final norm keeps its input (the last layer's output) and the output layer its input (the norm's output)
    final_norm = 2 * tokens * model.hidden_size // layout.seq_shards * training.dtype_bytes
    logits = [tokens * vocab // layout.tp * (training.dtype_bytes + 4) + final_norm if r == last else 0
              for r in range(layout.pp)]
    # the embedding's dropout keeps a one-byte mask of its output on the first stage (planner-census-session56, E8)
    embedding_mask = tokens * model.hidden_size // layout.seq_shards if training.hidden_dropout > 0 else 0

    def rank_chunks(r: int, chunks: tuple[range, ...]) -> list[ChunkLayers]:
        out = [chunk_layers([layers[kind_of[i]] for i in rng]) for rng in chunks]
        if r == 0 and embedding_mask and out[0].saved_bytes:
            first = out[0]
            out[0] = replace(first, saved_bytes=(first.saved_bytes[0] + embedding_mask, *first.saved_bytes[1:]))
        return out

    timelines = tuple(
        rank_timeline(r, layout.pp, rank_chunks(r, chunks), training.num_microbatches, logits[r],
                      tokens * vocab // layout.tp * 4 + final_norm if r == last else 0)
        for r, chunks in enumerate(assignment))
    baseline = [t.baseline_bytes for t in timelines]
    target = None if config.memory_target_gib is None else int(config.memory_target_gib * GIB)
    subsets = [frozenset(c) for n in range(len(OFFLOAD_MODULES) + 1)
               for c in itertools.combinations(OFFLOAD_MODULES, n)]
    demands = [RankDemand(off, None if target is None else static + base - target,
                          {s: t.delta_peak(s) for s in subsets})
               for off, static, base, t in zip(offloaded, statics, baseline, timelines)]
    rec = recommend(costs, hw.link, demands, max_exposed=config.max_exposed,
                    attn_proj_alone=attn_proj_frees_alone(training.recomputed, training.fp8))

    sets, freed = [], {}
    for label, modules in _offload_sets(layers, training, rec):
        per_kind = {k: costs[k].set_bytes(modules) for k in layers}
        timing = {k: transfer_timing(per_kind[k], fwd[k], hw.link) for k in layers}
        exposed = max(t.exposed_fraction for t in timing.values())
        sets.append(OffloadSet(label, modules, per_kind, timing, exposed, exposed <= config.max_exposed))
        freed[label] = freed_bytes(modules, costs, demands)

    ranks = []
    for r, chunks in enumerate(assignment):
        chunk_plans = tuple(ChunkPlan(c, rng, dict(Counter(kind_of[i] for i in rng)), peaks[r].forward_chunks.count(c))
                            for c, rng in enumerate(chunks))
        act = {s.label: baseline[r] - freed[s.label][r] for s in sets}
        where = {s.label: timelines[r].binding_instant(s.modules).label for s in sets}
        ranks.append(RankPlan(r, chunk_plans, peaks[r], offloaded[r], statics[r], logits[r], act, where))
    warnings = _warnings(config, layers, sets, ranks, rec, target)
    for w in warnings:
        logger.debug("plan: %s", w)
    return Plan(config, schedule_name(layout), layers, fwd, tuple(sets), tuple(ranks), rec, tuple(warnings),
                timelines)


def _warnings(config: PlanConfig, layers: Mapping[str, LayerActivations], sets: list[OffloadSet],
              ranks: list[RankPlan], rec: Recommendation, target: int | None) -> list[str]:
    model, layout, training = config.model, config.layout, config.training
    out: list[str] = []
    for acts in layers.values():
        out.extend(n for n in acts.notes if n not in out)
    for m in training.offload_modules:
        if all(acts.points[m].offloaded_bytes == 0 for acts in layers.values()):
            note = next(iter(layers.values())).points[m].note
            out.append(f"requested {m} moves nothing here: {note}")
    requested = next((s for s in sets if s.label == "requested"), None)
    if requested is not None and not requested.hidden:
        out.append(f"the requested set leaves {requested.exposed_fraction:.1%} of compute exposed "
                   f"(budget {config.max_exposed:.0%}); its peak reduction assumes the copies keep up with the "
                   "forward, an upper bound where they trail it (docs/plan.md); if memory is tight, set "
                   "MCORE_OFFLOAD_D2H_IN_FLIGHT=1 so that the memory held follows the memory allocated "
                   "(docs/tuning.md)")
    if layout.sequence_parallel and layout.tp == 1:
        out.append("--sequence-parallel has no effect with TP=1 (Megatron-LM turns it off)")
    if training.recompute_modules and training.recompute_granularity != "selective":
        out.append("--recompute-modules only applies with --recompute-granularity selective")
    if (training.recompute_method or training.recompute_num_layers) and not training.full_recompute:
        out.append("--recompute-method and --recompute-num-layers only apply with --recompute-granularity full")
    if all(acts.checkpoint for acts in layers.values()):
        out.append("full recompute checkpoints every layer: each keeps at most its input, and offloading moves "
                   "nothing (a run refuses offloading here)")
    elif any(acts.checkpoint for acts in layers.values()):
        out.append(f"full recompute, block of {training.recompute_num_layers}: the first "
                   f"{training.recompute_num_layers} layer(s) of each model chunk keep only their input and move "
                   "nothing (kinds marked rc); the others offload as usual")
    if not training.te:
        out.append("local spec: bytes per point validated at TP = 1 only; its backward working set is TE's "
                   "(peaks came out 1.7-5 % high), and the s^2 probabilities can outrun the link: a set whose "
                   "copies trail the forward lowers the peak by less than projected (docs/plan.md)")
    if model.num_experts:
        note = ("MoE bytes assume balanced routing: each rank's experts receive seq x mbs x topk / d x ETP rows; "
                "MoE peaks are validated at TP = EP = 1 only (docs/plan.md)")
        if layout.ep > 1:
            # E-ep2 (2x H200, session 64): the two ranks moved 1927 and 1657 MiB a step where this projects 1792 each
            note += "; at EP = 2 a measured run's ranks moved 7.5 % more and less than this (their sum exact)"
        out.append(note)
        if not training.moe_grouped_gemm:
            local = model.num_experts // layout.ep
            # session 82 (1 x H200, 64 experts, 4 layers x 4 microbatches): 25.5-43.5 ms a step with the experts
            # sharing a group per layer, 71-80 ms with a group per expert (session 81)
            out.append(f"SequentialMLP experts (no --moe-grouped-gemm): each of the {local} local experts runs its "
                       "own expert_fc1 and moe_act points (one group per layer), about 25-45 us of the runtime's host "
                       "time per expert, layer and microbatch where they are offloaded (session 82: 64 experts cost "
                       "+8.5 to +8.8 % a step, paired); grouped GEMM runs them once")
    if model.name == "deepseek-v3":
        out.append("deepseek-v3: multi-latent attention is modelled as standard attention (128 heads of 128)")
    if target is not None:
        over = [r.rank for r in ranks if r.total_bytes("recommended") > target]
        if over:
            out.append(f"rank(s) {over} stay above the {config.memory_target_gib:g} GiB target with the "
                       "recommended set")
    for r in ranks:
        if r.total_bytes("none") > config.hardware.memory_gib * GIB:
            out.append(f"rank {r.rank} projects {r.total_bytes('none') / GIB:.1f} GiB without offloading, more "
                       f"than the {config.hardware.name}'s {config.hardware.memory_gib:g} GiB")
            break
    return out
