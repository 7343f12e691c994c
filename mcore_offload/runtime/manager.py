"""The step manager: which handler is forwarding, which handlers await backward, and the byte counters.

One handler is created per (model chunk, microbatch) when a training forward of a ``GPTModel`` starts.
Backward needs no schedule model: every GroupCommit / GroupStart node (or node hook) carries its own handler,
so handlers reach backward in exactly the order the schedule (no pipelining, 1F1B or interleaved) runs
them, whatever the number of microbatches. The manager only decides *when* a handler's last layer is
flushed: when another chunk's forward or backward comes first, or, where the last step showed that one would,
as soon as the chunk's forward ends (``end_chunk``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from time import perf_counter_ns
from typing import Any

import torch

from mcore_offload.config import choice_env
from mcore_offload.runtime.auto import AutoPlanner, attention_units, clock_mark, elapsed_ms, parse_auto
from mcore_offload.runtime.auto_choice import Plan
from mcore_offload.runtime.burst_settings import flush_layers_from_env, prefetch_from_env, reload_layers_from_env
from mcore_offload.runtime.enabled import enabled_points_cached, in_backward, point_enabled
from mcore_offload.runtime.handler import ChunkOffloadHandler
from mcore_offload.runtime.host_ahead import HostAheadAdapter
from mcore_offload.runtime.host_pool import host_memory_kind
from mcore_offload.runtime.native import load_native
from mcore_offload.runtime.saved import CHAIN_NEXT, Entry, Group, saved_nothing_line
from mcore_offload.runtime.side_streams import side_stream_kind
from mcore_offload.runtime.transport import (
    d2h_in_flight_from_env,
    forward_end_from_env,
    live_transports,
    reset_transports,
    settle_pools,
)
from mcore_offload.summary import OffloadSummary

logger = logging.getLogger(__name__)


#: training steps in which a chunk's parameter storages are walked before the set is kept (see begin_chunk)
PROTECTED_WALKS = 2


def _parameter_storages(model: torch.nn.Module) -> tuple[torch.device | None, set[int]]:
    """The chunk's device and the storages of its parameters and main_grad buffers (never offloaded)."""
    params = list(model.parameters())
    if not params:
        return None, set()
    protected = {p.untyped_storage().data_ptr() for p in params}
    protected |= {p.main_grad.untyped_storage().data_ptr() for p in params
                  if getattr(p, "main_grad", None) is not None}
    return params[0].device, protected


def _chunk_backward_starts(handler: ChunkOffloadHandler, grad: torch.Tensor) -> None:
    t0 = perf_counter_ns()
    handler.on_chunk_backward_start()
    handler.summary.runtime_ns += perf_counter_ns() - t0


def peak_statistics(device: torch.device) -> tuple[Callable[[], int], Callable[[], None]] | None:
    """The allocator's peak statistic of ``device`` (read, reset); None where there is none (the CPU)."""
    if device.type != "cuda":
        return None
    return (functools.partial(torch.cuda.max_memory_allocated, device),
            functools.partial(torch.cuda.reset_peak_memory_stats, device))


class OffloadManager:
    """Per-process offload state. :func:`get_manager` gives the instance; :meth:`reset` clears it."""

    # What the C++ runtime reads (about 60 times a layer-microbatch) as slots, one load each (native/member_slots.cpp);
    # the rest in the instance dict
    __slots__ = ("summary", "forward_handler", "auto", "open_groups", "chain", "chain_next", "chaining", "node_hooks",
                 "split_chains", "_chunk_layers", "prefetch", "_peak_reader", "flush_layers", "reload_layers",
                 "second_look", "offload_log", "handlers", "__dict__", "__weakref__")

    def __init__(self) -> None:
        self.summary = OffloadSummary()
        # the points whose "saved nothing to offload" line was logged: once per point, so the points' exits skip
        # the line's arguments after that (a fused norm with the TE spec saves nothing at every layer)
        self.announced_points: set[str] = set()
        self.auto: AutoPlanner | None = None  # offload_modules=["auto"...]: probe, then a plan
        # Opt-in audit (tests, ``pretrain_gpt.py --audit-offloaded``): set to a list and every offloaded
        # storage appends (device address, bytes); the caller checks them against what must stay.
        self.offload_log: list[tuple[int, int]] | None = None
        self.pause_depth = 0  # > 0 inside ``paused()``: chunks that start forwarding offload nothing
        # Consecutive points of one layer share a group (runtime/points.py); MCORE_OFFLOAD_CHAIN_POINTS=0: one
        # group per point, as before (for comparisons)
        self.chaining = os.environ.get("MCORE_OFFLOAD_CHAIN_POINTS", "1") != "0"
        # and a SequentialMLP's experts share theirs (points.expert_loop); MCORE_OFFLOAD_EXPERT_LOOP=0: one per expert
        self.expert_loop = choice_env("MCORE_OFFLOAD_EXPERT_LOOP", "1", ("0", "1")) == "1"
        # MCORE_OFFLOAD_NODE_HOOKS=0: identity autograd nodes at every group's start and commit, as before
        # (runtime/points.py: NodeHook)
        self.node_hooks = os.environ.get("MCORE_OFFLOAD_NODE_HOOKS", "1") != "0"
        self.flush_layers = flush_layers_from_env()
        self.reload_layers = reload_layers_from_env()
        self.prefetch = prefetch_from_env()
        # a chain's first point reloads in a part of its own, waited for where its backward starts (prefetch.py)
        self.split_chains = choice_env("MCORE_OFFLOAD_SPLIT_CHAINS", "1", ("0", "1")) == "1"
        self.host_memory = host_memory_kind()  # a bad MCORE_OFFLOAD_HOST_MEMORY fails here, before any step
        self.side_streams = side_stream_kind()  # and a bad MCORE_OFFLOAD_SIDE_STREAMS
        d2h_in_flight_from_env()  # and a bad MCORE_OFFLOAD_D2H_IN_FLIGHT (the transports read it when made)
        forward_end_from_env()  # and MCORE_OFFLOAD_FORWARD_END
        # the copy-out settings by how far the host runs ahead of the GPU (runtime/host_ahead.py)
        self.host_ahead = self.summary.host_ahead = HostAheadAdapter()
        # the C++ saved-tensor hooks (runtime/native), or None: the Python ones (MCORE_OFFLOAD_NATIVE)
        self.native = load_native()
        if self.native is not None:  # the C++ paths add their host time to an int64 (summary_calls.cpp)
            self.summary.native_clock = self.native.RuntimeClock()
        # the offload points' forward glue in C++ (runtime/native/points_block.cpp) where the C++ hooks are loaded;
        # MCORE_OFFLOAD_NATIVE_POINTS=0: points.py's Python glue with the C++ hooks (for comparisons)
        self.native_points = self.native if os.environ.get("MCORE_OFFLOAD_NATIVE_POINTS", "1") != "0" else None
        # vp_stage -> the layers its chunk ran in its last finished forward (layer_boundary aligns bursts to it)
        self._chunk_layers: dict[int | None, int] = {}
        # (vp_stage, microbatch) of the chunks whose own backward came right after their forward, in the last
        # training step and in this one: a schedule repeats itself, so a chunk not in the last step's set has its
        # last layer flushed as soon as its forward ends (end_chunk), not when the next chunk starts
        self._kept_before: set[tuple[int | None, int]] | None = None
        self._kept_now: set[tuple[int | None, int]] = set()
        self.early_flushes = 0  # chunks whose last layer left at end_chunk (tests)
        self.second_look_bytes = 0  # bytes copied by ChunkOffloadHandler.second_look (tests)
        # MCORE_OFFLOAD_SECOND_LOOK=0: what a flush leaves because another tensor holds it stays until its backward,
        # as before the second look (runtime/second_look.py; to measure what the look costs, or to spare its copies)
        self.second_look = choice_env("MCORE_OFFLOAD_SECOND_LOOK", "1", ("0", "1")) == "1"
        # chunk -> (its device, its parameter and main_grad storages, training steps it was walked in)
        self._protected: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._step_serial = 0  # schedule calls ended so far
        self.reset_step()

    def reset_step(self) -> None:
        self.handlers: list[ChunkOffloadHandler] = []
        self.forward_handler: ChunkOffloadHandler | None = None
        # point name -> (handler, group) whose ``offload`` block closed and whose ``commit`` has not come yet
        self.open_groups: dict[str, tuple[ChunkOffloadHandler, Group]] = {}
        # a committed point whose group the next point of the layer joins: (handler, group, that next point)
        self.chain: tuple[ChunkOffloadHandler, Group, str] | None = None
        self.chain_next: dict[str, str] = CHAIN_NEXT  # which point joins which one's group (an expert loop's own)
        self._microbatches: dict[int | None, int] = {}
        self._peak_reader: Any = None  # auto's peak step: the allocator's peak
        self._trained = False  # a training forward ran in this schedule call

    # ------------------------------------------------------------------------------- forward side
    def begin_chunk(self, config: Any, vp_stage: int | None, model: torch.nn.Module) -> None:
        """A model chunk's forward starts: open a handler if this is a training forward."""
        t0 = perf_counter_ns()
        try:
            self._begin_chunk(config, vp_stage, model)
        finally:
            self.summary.runtime_ns += perf_counter_ns() - t0

    def _begin_chunk(self, config: Any, vp_stage: int | None, model: torch.nn.Module) -> None:
        self.close_chain()
        if self.forward_handler is not None:
            self.forward_handler.flush()
            self._forward_ended(self.forward_handler)
        self.forward_handler = None
        self.open_groups.clear()
        self._look_again(None)
        if not getattr(config, "fine_grained_activation_offloading", False):
            return
        if not model.training or not torch.is_grad_enabled() or in_backward() or self.pause_depth:
            return
        target = parse_auto(config.offload_modules)
        if target is not False and self.auto is None:
            self.auto = AutoPlanner(target, attention_units(config))
            self.summary.exposed_copies_warned = True  # its probes run the full set on purpose; its plan line speaks
        found = self._protected.get(model)
        if found is None or (found[2] < PROTECTED_WALKS and found[3] != self._step_serial):
            # Walking every parameter costs about a millisecond on a large chunk, and storages are fixed once
            # training runs: walked in the first PROTECTED_WALKS steps (main_grad buffers made lazily by the first
            # backward are in the second walk), then kept. A storage this set misses is still never offloaded
            # while its parameter lives: the parameter's reference makes the flush's use-count test skip it (where
            # torch exposes storage use counts; saved.held_elsewhere).
            walks = 0 if found is None else found[2]
            found = self._protected[model] = (*_parameter_storages(model), walks + 1, self._step_serial)
        device, protected = found[0], found[1]
        if device is None:
            return
        mb = self._microbatches.get(vp_stage, 0)
        self._microbatches[vp_stage] = mb + 1
        handler = ChunkOffloadHandler(self, vp_stage, mb, device, int(config.min_offloaded_tensor_size), protected)
        # The points this chunk's config can enable at all: the other points of every layer leave ``offload``
        # on one set lookup (six of seven points per layer with a one-point set; each lookup is step time).
        handler.config = config
        handler.enabled_points = enabled_points_cached(config)
        self.handlers.append(handler)
        self.forward_handler = handler
        self._trained = True
        self.host_ahead.chunk_started(self, handler.transport)  # the copy-out settings (runtime/host_ahead.py)
        stats = (peak_statistics(device) if self.auto is not None and self.auto.tracing_peak
                 and self._peak_reader is None else None)
        if stats is not None:
            # The plan needs the peak and which groups were off the device then: under pipeline parallelism a chunk's
            # last layer is back on the device at the peak, and offloading it saves nothing there. The peak that
            # counts is the one the step would reach without offloading, not the probe's own (runtime/peak_trace.py),
            # so the allocator's peak statistic is reset at the peak step's first chunk and at each of our release and
            # reload events in it (documented side effect: that step's max_memory_allocated() is its last interval's).
            self._peak_reader, reset = stats
            reset()
            self.summary.track_peak(self._peak_reader, by_key=True, reset_peak=reset)
        if self.auto is not None and self.auto.measuring:
            handler.marks = self.auto.chunk_started(vp_stage)
            telemetry = handler.transport.telemetry
            telemetry.timing = telemetry.timed  # the plan reads this step's link throughput

    def end_chunk(self, output: Any) -> None:
        """The chunk's decoder returned ``output``: when its gradient arrives, the chunk's backward starts.

        If in the last step this chunk's backward did not follow its forward right away, its last layer is
        flushed now: the copy overlaps the pipeline's send and receive instead of the next chunk's first layer,
        and the memory is back sooner (under PP, at the peak). A wrong guess costs only a copy and its reload.
        """
        handler = self.forward_handler
        if handler is None or not handler.opened or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        t0 = perf_counter_ns()
        output.register_hook(functools.partial(_chunk_backward_starts, handler))
        kept = self._kept_before
        if kept is not None and (handler.vp_stage, handler.microbatch) not in kept:
            self.close_chain()
            if handler.pending:
                handler.flush()
                self.early_flushes += 1
        # The output layer and the loss come next, often the step's peak: copied blocks must not wait for the
        # next layer's flush to go back to the allocator.
        self._forward_end(handler)
        self.summary.runtime_ns += perf_counter_ns() - t0

    def handler_for(self, config: Any, name: str | None) -> ChunkOffloadHandler | None:
        """The handler an offload point should use now, or None when the point is off.

        ``points.offload`` and ``points.commit`` answer the common case (the forward chunk's own config, no auto)
        inline, without this call, and so does ``runtime/native/points_block.cpp`` (``point_on``): a change here changes
        them too (tests/test_chain.py and tests/test_native_points.py compare the ways)."""
        handler = self.forward_handler
        if handler is None:
            return None
        # the forward chunk's own config: its enabled points are a set already (offload() and commit() ask once per
        # point and layer)
        if not (name in handler.enabled_points if config is handler.config else point_enabled(config, name)):
            return None
        if not torch.is_grad_enabled() or in_backward():
            return None
        if self.auto is not None and not self.auto.enabled(handler.vp_stage, handler.layers, name):
            return None
        return handler

    def layer_boundary(self) -> None:
        """A transformer layer starts: the previous layer's groups may leave the device.

        ``runtime/native/layer_boundary.cpp`` does the same where auto is off (with :meth:`_flush_due`'s rule): a
        change here changes it too (tests/test_native_link_calls.py compares the two)."""
        handler = self.forward_handler
        if handler is not None and not in_backward():
            t0 = perf_counter_ns()
            self.close_chain()
            handler.layers += 1
            if self._flush_due(handler):
                handler.flush()
            if handler.marks is not None:
                handler.marks.layer_started(clock_mark(handler.device))
            if self._peak_reader is not None:
                live = Counter(h.vp_stage for h in self.handlers if not h.finished)
                self.auto.peak_check(self.summary.peak_so_far(), live)
            self.summary.runtime_ns += perf_counter_ns() - t0

    def _flush_due(self, handler: ChunkOffloadHandler) -> bool:
        """Whether the layer starting now copies the pending groups out.

        Every copy burst costs the same few CUDA calls (a fence, a cross-stream wait, a done event, a completion
        query: 8-10 µs of host time each in a launch-bound step) whatever it carries, so ``flush_layers`` layers
        share one. The bursts are aligned to the chunk's end, known from its last forward: the last two layers
        flush at their own start, so what is still in flight when the forward ends is one layer's groups, as with
        one burst per layer, and the output layer and the loss (often the step's peak) find the memory back. The
        first forward of a chunk, and the auto probe's measured step, flush every layer.
        """
        k = self.flush_layers
        expected = self._chunk_layers.get(handler.vp_stage)
        if k == 1 or expected is None or handler.marks is not None or handler.layers >= expected - 1:
            return True
        return (expected - 1 - handler.layers) % k == 0

    def point_saved_nothing(self, name: str, rejected: dict[str, int]) -> None:
        """Point ``name``'s block ended without a tensor to offload (``rejected``: why its saved tensors stay)."""
        if name not in self.announced_points:
            self.announced_points.add(name)
            logger.info("%s", saved_nothing_line(name, rejected))

    def close_chain(self) -> None:
        """The point a group waited for did not come in this layer: the group is queued as it is.

        It has no commit node, so backward reloads it with the prefetch of a later group or, failing that,
        when a saved tensor is unpacked (correct, possibly exposed); chains only pair points that always follow
        each other, so this is the unusual path (an exception, a layer without the second point).
        """
        chain = self.chain
        if chain is not None:
            self.chain = None
            handler, group, waited_for = chain
            logger.debug("offload point %s did not follow %s in this layer", waited_for, group.points[-1])
            if not group.done:  # a chunk's last layer may reach its backward first: then it stays on the device
                handler.on_group_commit_forward(group)

    # ------------------------------------------------------------------------------ backward side
    def on_backward(self, handler: ChunkOffloadHandler) -> None:
        """A handler's backward is running: the chunk still forwarding-pending must flush first."""
        self.close_chain()
        fwd = self.forward_handler
        if fwd is handler:
            if not handler.backward_started:  # no other chunk ran forward in between (see end_chunk)
                self._kept_now.add((handler.vp_stage, handler.microbatch))
        elif fwd is not None and fwd.pending:
            fwd.flush()
        if not handler.backward_started:
            # A model that never called end_chunk: its forward's copied blocks go back before its backward (this runs
            # twice per chunk, the output's gradient, then the last group's commit, after end_chunk's own)
            self._forward_end(handler)
            self._look_again(handler)
        self._forward_ended(handler)

    @staticmethod
    def _forward_end(handler: ChunkOffloadHandler) -> None:
        """The chunk's forward ended: its copied blocks go back (``Transport.release_copied(final=True)``), and the
        first call for the chunk counts that end (``Transport.end_forward``), so the forward count is not tripled."""
        if handler.forward_end_counted:
            handler.transport.release_copied(final=True)
        else:
            handler.transport.end_forward()
            handler.forward_end_counted = True

    def _look_again(self, starting: ChunkOffloadHandler | None) -> None:
        """Every chunk whose forward has returned and whose backward has not started (``starting``'s is starting)
        copies what its flushes left because another tensor held it, where nothing does now
        (ChunkOffloadHandler.second_look). Runs as a forward starts and as a chunk's backward starts: by then
        no chunk's forward is running."""
        for handler in list(self.handlers):  # a copy: nothing here should finish a handler, but it would not break
            if handler.held_back and handler is not starting:
                handler.second_look()

    def _forward_ended(self, handler: ChunkOffloadHandler) -> None:
        """A chunk's forward ended (the first of: next chunk starts, its backward): its layer count for the next
        forward's bursts, and the auto probe's end mark."""
        if handler.layers:
            self._chunk_layers[handler.vp_stage] = handler.layers
        if handler.marks is not None and handler.marks.end is None:
            handler.marks.end = clock_mark(handler.device)

    def on_handler_finished(self, handler: ChunkOffloadHandler) -> None:
        if handler in self.handlers:
            self.handlers.remove(handler)
        if self.forward_handler is handler:
            self.forward_handler = None

    def end_step(self, aborted: bool = False) -> None:
        """End of a schedule call (training or forward-only, normal or by exception): leave no state."""
        if not aborted:
            self.close_chain()
        leftovers = [h for h in self.handlers if not h.finished]
        if aborted and leftovers:
            logger.warning("step aborted: dropping offload state of %d chunk(s)", len(leftovers))
            for h in leftovers:
                h.transport.synchronize()
        for h in leftovers:
            h.finish(abort=aborted)
        settle_pools()  # before the step's allocations are counted: a replacement is this step's
        if self.summary.step_has_activity():
            self.summary.close_step(aborted=aborted)
            if self._trained:
                self.host_ahead.step_closed(self.summary, self, live_transports(),
                                            planning=self.auto is not None and self.auto.plan is None)
        if self.auto is not None and self._trained:
            if aborted:
                self.auto.step_aborted()  # the step repeats its probe role: nothing of it is kept
            else:
                self._plan()
        if self._trained:  # the next step's guess (end_chunk); an aborted step's schedule is not a guide
            self._kept_before = None if aborted else self._kept_now
            self._kept_now = set()
        if self._peak_reader is not None:  # an aborted peak step: the next one traces again
            self.summary.stop_tracking_peak()
            self.summary.peak_trace = None
        self._step_serial += 1
        self.reset_step()

    def _plan(self) -> Plan | None:
        """End of an auto step: at the end of the measured one, read its clocks (syncs once); at the end of the peak
        step, read the peak and choose."""
        link, peak, runtime_ms = None, None, 0.0
        if self.auto.measuring:
            self.summary.resolve_link(wait=True)
            last = self.summary.last_step
            link = last.link.d2h_GBps if last is not None and last.link is not None else None
            runtime_ms = last.runtime_cpu_ms if last is not None and last.runtime_cpu_ms is not None else 0.0
            if link is None:  # CPU: copies are memcpy, never the limit
                link = 1000.0
        elif self.auto.tracing_peak and self._peak_reader is not None:
            self.summary.stop_tracking_peak()  # reads the last interval's peak
            peak = self.summary.traced_peak_bytes
            self._peak_reader = None
        trace, self.summary.peak_trace = self.summary.peak_trace, None
        return self.auto.step_ended(elapsed_ms, link, peak, self.summary.off_device_at_peak_bytes, runtime_ms,
                                    self.chaining, self.summary.off_by_key_at_peak if peak is not None else None,
                                    trace=trace if peak is not None else None)

    # ------------------------------------------------------------------------------------ counters
    def on_offloaded(self, entry: Entry) -> None:
        if self.offload_log is not None:
            self.offload_log.append((entry.device_ptr, entry.nbytes))
        self.summary.add(entry.point, "offloaded", entry.nbytes)
        self.summary.host_resident(+entry.nbytes)

    def on_released(self, entry: Entry, during_forward: bool) -> None:
        self.summary.add(entry.point, "released_in_forward" if during_forward else "released_late",
                         entry.nbytes)
        if entry.host is not None and entry.device_storage is None:
            entry.off_device = True
            self.summary.off_device(+entry.nbytes, entry.peak_key)

    def on_reloaded(self, entry: Entry, on_demand: bool = False) -> None:
        self.summary.add(entry.point, "reloaded", entry.nbytes)
        if on_demand:
            self.summary.add_on_demand(entry.point, entry.peak_key, entry.nbytes)
        self._back_on_device(entry)

    def on_hosts_freed(self, entries: list[Entry]) -> None:
        """A chunk's host copies went back to the pool (its finish): one count for all of them (a fall of the
        host-resident bytes moves no peak), and each entry still counted off the device comes back (an aborted step
        never reloads: the bytes are simply gone)."""
        self.summary.host_resident(-sum(e.nbytes for e in entries))
        for entry in entries:
            if entry.off_device:
                self._back_on_device(entry)

    def before_reload(self, entries: list[Entry]) -> None:
        """A reload burst is about to allocate ``entries``' storages. While the plain step's peak is traced, they
        count as back on the device first: the interval that allocates them would otherwise hold them twice."""
        if self.summary.traces_plain_peak:
            for entry in entries:
                self._back_on_device(entry)

    def _back_on_device(self, entry: Entry) -> None:
        if entry.off_device:
            entry.off_device = False
            self.summary.off_device(-entry.nbytes, entry.peak_key)

    def on_skipped(self, point: str, nbytes: int) -> None:
        self.summary.add(point, "skipped_aliased", nbytes)

    def on_kept(self, group: Group) -> None:
        nbytes: dict[str, int] = {}
        for r in group.refs:
            if r.tensor is not None:
                nbytes[r.point] = nbytes.get(r.point, 0) + r.tensor.numel() * r.tensor.element_size()
        for point in group.points:
            self.summary.add(point, "kept_on_device", nbytes.get(point, 0))


_MANAGER: OffloadManager | None = None


def get_manager() -> OffloadManager:
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = OffloadManager()
    return _MANAGER


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No model chunk whose forward starts inside this block offloads anything (nestable).

    For steps that should run as if offloading were off without rebuilding the model: a benchmark that
    alternates offloaded and plain steps in one process (``pretrain_gpt.py --alternate-offload``), or a step
    that must not touch host memory. Chunks that started before the block keep offloading.
    """
    manager = get_manager()
    manager.pause_depth += 1
    try:
        yield
    finally:
        manager.pause_depth -= 1


def reset() -> None:
    """Forget all offload state, counters, streams and host buffers (tests; between independent runs)."""
    global _MANAGER
    if _MANAGER is not None:
        _MANAGER.end_step(aborted=True)
    _MANAGER = None
    reset_transports()
