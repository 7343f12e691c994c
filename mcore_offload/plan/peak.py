"""What the runtime offloads in one step, what is off the device at a rank's memory peak, and the peak.

The runtime (docs/how-it-works.md) as the planner models it:

* a chunk forward's groups leave the device at each layer boundary; those of its last layer leave when the
  next chunk forward or backward starts, or never, when the chunk's own backward comes next
  (:func:`~mcore_offload.plan.schedule.kept_forwards`: every microbatch at PP = 1, the last stage's last
  chunk under 1F1B and interleaving);
* in backward, a group's commit reloads the group and starts the reload of the previous group that holds
  anything (``COMMIT_ORDER``, across the layers of the same chunk): one group of prefetch.

Bytes per step: every chunk forward of the step offloads each of its layers' groups, except the last layer
of a kept forward. A chunk's first layer moves less with ``qkv_linear``: its input is held elsewhere while the
layers flush (``ChunkLayers.held_bytes``). The runtime's second look (``runtime/second_look.py``, since commit
0055084) copies that input out once the chunk's forward has returned, before its backward starts, if nothing else
holds it then. Only the first stage's first chunk qualifies at PP > 1 (its input is the embedding output, held by
``GPTModel.forward`` during the flush); inputs received from the previous stage stay held by the schedule, and a
kept forward gets no second look (its own backward comes next; at PP = 1 every forward is kept). So each non-kept
forward of rank 0's chunk 0 also moves its first layer's held bytes, and they stay off the device until that
backward reaches the first layer: like the last layer's groups, they are still on the device at the forward end of
that very forward and at the backward start of a kept forward. :meth:`RankTimeline.without_second_look` gives the
runtime before it (the issue-4 fixtures of tests/test_plan_validation.py).

A rank's memory peaks at one of two instants around a switch from a chunk forward ``F`` to a chunk backward
``B`` in its schedule (every such switch is evaluated):

* forward end: every in-flight chunk forward is resident, and on the loss chunk the logits with the cross
  entropy's fp32 copy (``T V/t (dtype + 4)``); off the device: all their groups except ``F``'s last layer
  (and ``F``'s held first-layer input, not looked at yet);
* backward start, during the core-attention backward of ``B``'s last layer ``l``: the logits are gone and
  the backward's working set is there (gradients and weight-gradient buffers, estimated as
  ``BACKWARD_WORKING_SET`` x the saved bytes of ``l``); off the device: all groups (``F``'s last layer has
  been flushed unless ``F`` is ``B``'s own forward, which kept it; so has every second look but a kept
  ``F``'s), less ``l``'s groups from ``core_attn`` on in commit order (reloaded by now) and the one group
  prefetched before them.

Projected activation peak without offloading: the largest instant. With a set ``S``: the largest instant less
what ``S`` has off the device at it. Delta peak: the difference (tests/test_plan_validation.py holds the GPU
measurements it is checked against).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from mcore_offload.config import OFFLOAD_MODULES
from mcore_offload.plan.activations import LayerActivations
from mcore_offload.plan.schedule import kept_forwards, pipeline_order

#: Backward working set of the first layer a backward reaches, in units of that layer's saved activations.
#: Calibrated on config B of benchmarks/results/issue4-h100-pp1 (8 layers of hidden 4096 against a 32000
#: vocabulary: its offloaded peak falls in that backward, 30 MiB below the forward end). Since session 56 the
#: forward end also holds the final norm's tensors and unfused RoPE's cos and sin: every validation row
#: (tests/test_plan_validation.py) holds from 1.225 to 1.35, and D's first stage, which peaks in a backward,
#: is within 0.7 % of its measured no-offload peak there (tests/test_plan_measurements.py).
BACKWARD_WORKING_SET = 1.25

#: The order in which a layer's groups commit in forward (the norms commit after their residual add).
COMMIT_ORDER: tuple[str, ...] = ("qkv_linear", "core_attn", "attn_proj", "attn_norm", "expert_fc1", "moe_act",
                                 "mlp_norm")
_RELOADED_FROM = COMMIT_ORDER.index("core_attn")

FORWARD_END = "forward end"
BACKWARD_START = "backward start"


@dataclass(frozen=True)
class Instant:
    """A moment that can hold a rank's peak (see the module docstring)."""

    kind: str  # FORWARD_END or BACKWARD_START
    in_flight: tuple[int, ...]  # resident chunk forwards, per chunk
    chunk: int  # forward end: the chunk that just ran forward; backward start: the chunk turning around
    kept: bool  # backward start: that chunk's own forward ran just before, so its last layer never left
    base_bytes: int  # activation bytes without offloading
    where: str

    @property
    def label(self) -> str:
        return f"{self.kind} ({self.where})"


@dataclass(frozen=True)
class ChunkLayers:
    """The layers of one model chunk on a rank: per layer, the bytes each point offloads, and saved bytes."""

    point_bytes: tuple[Mapping[str, int], ...]
    saved_bytes: tuple[int, ...]
    #: Per point, what the first layer would move more if its input were not held elsewhere at the flush: what
    #: a second look copies out (``point_bytes`` leaves it out).
    held_bytes: Mapping[str, int] = field(default_factory=dict)
    #: The backward's working set when the chunk's backward reaches its last layer (:func:`chunk_layers`).
    backward_work: int = 0

    def bytes(self, modules: Iterable[str], layer: int | None = None) -> int:
        """Bytes ``modules`` offloads from one layer (``layer``) or from the whole chunk."""
        layers = self.point_bytes if layer is None else (self.point_bytes[layer],)
        return sum(lb[m] for lb in layers for m in modules)

    def held(self, modules: Iterable[str]) -> int:
        """Bytes of the first layer's held input that ``modules`` would move."""
        return sum(self.held_bytes.get(m, 0) for m in modules)

    def looked(self) -> ChunkLayers:
        """This chunk once a second look has moved its first layer's input (its groups are reloaded with it)."""
        first = {m: b + self.held_bytes.get(m, 0) for m, b in self.point_bytes[0].items()}
        return replace(self, point_bytes=(first, *self.point_bytes[1:]), held_bytes={})


@dataclass(frozen=True)
class RankTimeline:
    """One pipeline rank's step as the runtime offloads it: see the module docstring."""

    rank: int
    chunks: tuple[ChunkLayers, ...]
    num_microbatches: int
    kept: tuple[int, ...]  # per chunk: forwards whose last layer is never copied
    instants: tuple[Instant, ...]
    #: Chunks whose non-kept forwards' held first-layer input a second look copies out (rank 0's chunk 0 at PP > 1).
    second_look: frozenset[int] = frozenset()

    def without_second_look(self) -> RankTimeline:
        """This rank under the runtime before commit 0055084 (no second look): what the issue-4 GPU runs measured."""
        return replace(self, second_look=frozenset())

    @property
    def baseline_bytes(self) -> int:
        """Projected activation peak without offloading."""
        return max(i.base_bytes for i in self.instants)

    def offloaded_at(self, instant: Instant, modules: Iterable[str]) -> int:
        """Bytes that set ``modules`` has off the device at ``instant``."""
        mods = _canonical(modules)
        total = sum(n * c.bytes(mods) for n, c in zip(instant.in_flight, self.chunks))
        total += sum(instant.in_flight[c] * self.chunks[c].held(mods) for c in self.second_look)
        chunk = self.chunks[instant.chunk]
        looked = instant.chunk in self.second_look
        if instant.kind == FORWARD_END or instant.kept:
            # Not flushed yet: the forward's last layer; not looked at yet (or never, if kept): its held input.
            total -= chunk.bytes(mods, -1) + (chunk.held(mods) if looked else 0)
        if instant.kind == BACKWARD_START:
            total -= _reloaded(chunk.looked() if looked and not instant.kept else chunk, mods, instant.kept)
        return total

    def peak_bytes(self, modules: Iterable[str]) -> int:
        """Projected activation peak with set ``modules``."""
        mods = _canonical(modules)
        return max(i.base_bytes - self.offloaded_at(i, mods) for i in self.instants)

    def delta_peak(self, modules: Iterable[str]) -> int:
        """How much set ``modules`` lowers the projected peak."""
        return self.baseline_bytes - self.peak_bytes(modules)

    def binding_instant(self, modules: Iterable[str]) -> Instant:
        """The instant that holds the peak with set ``modules``."""
        mods = _canonical(modules)
        return max(self.instants, key=lambda i: i.base_bytes - self.offloaded_at(i, mods))

    def offloaded_per_step(self, modules: Iterable[str]) -> dict[str, int]:
        """Per point, the bytes set ``modules`` copies to the host in one step (all microbatches and layers)."""
        out = {}
        for m in _canonical(modules):
            out[m] = sum(self.num_microbatches * c.bytes((m,)) - k * c.bytes((m,), -1)
                         for c, k in zip(self.chunks, self.kept))
            out[m] += sum((self.num_microbatches - self.kept[c]) * self.chunks[c].held((m,)) for c in self.second_look)
        return out


def _canonical(modules: Iterable[str]) -> tuple[str, ...]:
    chosen = set(modules)
    return tuple(m for m in OFFLOAD_MODULES if m in chosen)


def _reloaded(chunk: ChunkLayers, modules: tuple[str, ...], kept: bool) -> int:
    """Bytes of the chunk's last layer back on the device during its core-attention backward, plus the one
    group prefetched before them (none of the last layer's if it was kept)."""
    last = chunk.point_bytes[-1]
    committed = [p for p in COMMIT_ORDER[_RELOADED_FROM:] if p in modules and last[p] > 0]
    if not committed:
        return 0
    reloaded = 0 if kept else sum(last[p] for p in committed)
    before = COMMIT_ORDER[:COMMIT_ORDER.index(committed[0])]
    candidates = [] if kept else [last[p] for p in reversed(before) if p in modules]
    for layer in reversed(chunk.point_bytes[:-1]):
        candidates += [layer[p] for p in reversed(COMMIT_ORDER) if p in modules]
    return reloaded + next((b for b in candidates if b > 0), 0)


def backward_work(layers: Sequence[LayerActivations]) -> int:
    """The working set when backward reaches the last of ``layers``: ``BACKWARD_WORKING_SET`` x its saved bytes;
    if it is under full recompute, its checkpoint first recomputes every layer of the checkpoint (each back at its
    unrecomputed size) and the backward then starts on the last of them."""
    if not layers:
        return 0
    last = layers[-1]
    if last.checkpoint is None:
        return int(BACKWARD_WORKING_SET * last.total_bytes)
    start = len(layers) - 1  # back to the layer that starts the last checkpoint
    while start > 0 and layers[start].checkpoint == "inner":
        start -= 1
    unit = len(layers) - start
    return int((unit - 1 + BACKWARD_WORKING_SET) * last.recomputed_bytes)


def chunk_layers(layers: Sequence[LayerActivations]) -> ChunkLayers:
    """A model chunk made of ``layers`` (in order; the first one is the chunk's first layer)."""
    held = {m: layers[0].point_bytes(m) - layers[0].point_bytes(m, first=True) for m in OFFLOAD_MODULES} \
        if layers else {}
    return ChunkLayers(
        tuple({m: acts.point_bytes(m, first=i == 0) for m in OFFLOAD_MODULES} for i, acts in enumerate(layers)),
        tuple(acts.total_bytes for acts in layers), held, backward_work(layers))


def rank_timeline(rank: int, pp: int, chunks: Sequence[ChunkLayers], num_microbatches: int, logits_bytes: int,
                  loss_saved_bytes: int) -> RankTimeline:
    """Walk rank ``rank``'s schedule and collect its candidate peak instants. ``logits_bytes``: what the loss
    chunk holds at its forward end; ``loss_saved_bytes``: what an in-flight loss chunk keeps for backward
    (both 0 off the last stage)."""
    vpp = len(chunks)
    order = pipeline_order(pp, rank, vpp, num_microbatches)
    kept = kept_forwards(order)
    loss_chunk = vpp - 1 if rank == pp - 1 and logits_bytes else None
    saved = [sum(c.saved_bytes) for c in chunks]
    in_flight = [0] * vpp
    instants: dict[tuple, Instant] = {}
    for prev, op in zip((None, *order), order):
        if op.forward:
            in_flight[op.chunk] += 1
            continue
        if prev is not None and prev.forward:
            resident = sum(n * s for n, s in zip(in_flight, saved))
            losses = in_flight[loss_chunk] if loss_chunk is not None else 0
            own = (prev.chunk, prev.microbatch) == (op.chunk, op.microbatch)
            fwd_loss = prev.chunk == loss_chunk
            bwd_loss = op.chunk == loss_chunk
            work = chunks[op.chunk].backward_work
            candidates = (
                Instant(FORWARD_END, tuple(in_flight), prev.chunk, own,
                        resident + (logits_bytes if fwd_loss else 0) + (losses - fwd_loss) * loss_saved_bytes,
                        f"chunk {prev.chunk} microbatch {prev.microbatch}"),
                Instant(BACKWARD_START, tuple(in_flight), op.chunk, own,
                        resident + work + (losses - bwd_loss) * loss_saved_bytes,
                        f"chunk {op.chunk} microbatch {op.microbatch}"),
            )
            for inst in candidates:
                key = (inst.kind, inst.in_flight, inst.chunk, inst.kept, inst.base_bytes)
                instants.setdefault(key, inst)
        in_flight[op.chunk] -= 1
    kept_per_chunk = tuple(sum(1 for c, _ in kept if c == chunk) for chunk in range(vpp))
    # Only the first stage's first chunk has an input (the embedding output) that nothing holds once its forward
    # has returned; at PP = 1 every forward is kept, so none would be looked at anyway.
    looks = frozenset({0}) if rank == 0 and pp > 1 else frozenset()
    return RankTimeline(rank, tuple(chunks), num_microbatches, kept_per_chunk, tuple(instants.values()), looks)
