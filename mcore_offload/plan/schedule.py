"""Which layers a pipeline rank holds, and how many chunk forwards are in flight at its memory peak.

megatron-core 0.15 (``pipeline_parallel/schedules.py``):

* no pipelining (PP = 1): each microbatch runs forward then backward, so one is in flight;
* 1F1B: rank ``r`` of ``p`` runs ``p - r - 1`` warm-up forwards, then one more forward before its first
  backward, so ``min(p - r, m)`` microbatches are in flight at the peak;
* interleaved 1F1B with ``v`` chunks: ``(p - r - 1) * 2 + (v - 1) * p`` warm-up chunk forwards, capped at
  ``m * v``, then one more; forwards go ``p`` microbatches at a time through chunk 0, then chunk 1, ...
  (``microbatch_group_size_per_vp_stage`` defaults to ``p``).

A rank's whole step is :func:`pipeline_order` (megatron-core's ``get_schedule_table`` and
``convert_schedule_table_to_order``): which chunk forward or backward runs when. :mod:`mcore_offload.plan.peak`
reads from it what is off the device at each candidate peak and which chunks keep their last layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_offload.plan.model import ParallelLayout


@dataclass(frozen=True)
class PeakLayers:
    """The layers whose activations a rank holds at its peak, with multiplicity (one entry per in-flight
    chunk forward and layer), and the layer whose groups have not left the device yet."""

    forward_chunks: tuple[int, ...]
    resident: tuple[int, ...]
    turning_layer: int

    @property
    def in_flight(self) -> int:
        return len(self.forward_chunks)


def stage_layer_counts(num_layers: int, layout: ParallelLayout) -> tuple[int, ...]:
    """Transformer layers per pipeline rank (uneven first/last stages as in Megatron-LM)."""
    pp = layout.pp
    first, last = layout.decoder_first_pipeline_num_layers, layout.decoder_last_pipeline_num_layers
    if first is None and last is None:
        return (num_layers // pp,) * pp
    fixed = {0: first, pp - 1: last}
    middle_ranks = [r for r in range(pp) if fixed.get(r) is None]
    middle = (num_layers - (first or 0) - (last or 0)) // len(middle_ranks) if middle_ranks else 0
    return tuple(fixed[r] if fixed.get(r) is not None else middle for r in range(pp))


def layer_assignment(num_layers: int, layout: ParallelLayout) -> tuple[tuple[range, ...], ...]:
    """``[rank][chunk]`` -> the global layer ids of that model chunk.

    Layers go chunk-major: chunk 0 of every rank in rank order, then chunk 1, ... (megatron-core's
    ``get_transformer_layer_offset``).
    """
    counts = stage_layer_counts(num_layers, layout)
    vpp = layout.vpp
    per_chunk = [c // vpp for c in counts]
    out: list[list[range]] = [[] for _ in counts]
    start = 0
    for _chunk in range(vpp):
        for rank, n in enumerate(per_chunk):
            out[rank].append(range(start, start + n))
            start += n
    return tuple(tuple(chunks) for chunks in out)


@dataclass(frozen=True)
class Op:
    """One chunk forward or backward of one microbatch, as a rank runs it."""

    forward: bool
    chunk: int
    microbatch: int


def schedule_table(num_microbatches: int, vpp: int, group_size: int) -> tuple[tuple[int, int], ...]:
    """(microbatch, chunk) of each virtual microbatch: ``group_size`` microbatches at a time through chunk 0,
    then chunk 1, ... (megatron-core's ``get_schedule_table``)."""
    table: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, group_size):
        stop = num_microbatches if start + group_size >= num_microbatches else start + group_size
        table.extend((mb, chunk) for chunk in range(vpp) for mb in range(start, stop))
    return tuple(table)


def pipeline_order(pp: int, rank: int, vpp: int, num_microbatches: int) -> tuple[Op, ...]:
    """Every chunk forward and backward of one step on ``rank``, in order: the warm-up forwards, then one
    forward and one backward at a time, then the remaining backwards. Backward ``i`` runs the ``i``-th entry of
    the schedule table with the chunk order reversed (the last chunk turns around first)."""
    table = schedule_table(num_microbatches, vpp, max(pp, 1))
    warm = warmup_forwards(pp, rank, vpp, num_microbatches)
    forwards = [Op(True, chunk, mb) for mb, chunk in table]
    backwards = [Op(False, vpp - 1 - chunk, mb) for mb, chunk in table]
    order = forwards[:warm]
    for i in range(warm, len(table)):
        order += [forwards[i], backwards[i - warm]]
    return tuple(order + backwards[len(table) - warm:])


def kept_forwards(order: tuple[Op, ...]) -> frozenset[tuple[int, int]]:
    """(chunk, microbatch) of the chunk forwards whose backward comes right after them: nothing flushes their
    last layer's groups, so the runtime never copies them."""
    return frozenset((a.chunk, a.microbatch) for a, b in zip(order, order[1:])
                     if a.forward and not b.forward and (a.chunk, a.microbatch) == (b.chunk, b.microbatch))


def warmup_forwards(pp: int, rank: int, vpp: int, num_microbatches: int) -> int:
    """Chunk forwards before the first backward (megatron-core's ``num_warmup_microbatches``)."""
    total = num_microbatches * vpp
    if pp == 1:
        return 0
    warm = pp - rank - 1 if vpp == 1 else (pp - rank - 1) * 2 + (vpp - 1) * pp
    return min(warm, total)


def in_flight_forwards(pp: int, rank: int, vpp: int, num_microbatches: int) -> int:
    """Chunk forwards whose activations are held at the peak: the warm-up plus one, at most all of them."""
    return min(warmup_forwards(pp, rank, vpp, num_microbatches) + 1, num_microbatches * vpp)


def forward_chunk(k: int, pp: int, vpp: int) -> int:
    """Model chunk of a rank's ``k``-th chunk forward (groups of ``pp`` microbatches per chunk)."""
    return (k % (pp * vpp)) // pp if vpp > 1 else 0


def peak_layers(chunks: tuple[range, ...], pp: int, rank: int, num_microbatches: int) -> PeakLayers:
    """What rank ``rank`` (holding ``chunks``) keeps at its peak; see :class:`PeakLayers`."""
    vpp = len(chunks)
    n = in_flight_forwards(pp, rank, vpp, num_microbatches)
    order = tuple(forward_chunk(k, pp, vpp) for k in range(n))
    resident = tuple(layer for c in order for layer in chunks[c])
    last_chunk = chunks[order[-1]]
    return PeakLayers(forward_chunks=order, resident=resident, turning_layer=last_chunk[-1])


def schedule_name(layout: ParallelLayout) -> str:
    if layout.pp == 1:
        return "no pipelining"
    return "interleaved 1F1B" if layout.vpp > 1 else "1F1B"
