"""``ChunkOffloadHandler``: the saved activations of one (model chunk, microbatch), group by group.

Life of a group (one named offload point in one layer):

1. forward, inside the point: the saved-tensor pack hook records every eligible tensor (a ``SavedRef``
   still holding it);
2. forward, at the point's commit: the group becomes *pending*;
3. forward, when the next layer starts (or another chunk starts, or another chunk's backward starts):
   pending groups are *flushed*: each distinct storage they save is copied to host memory on the D2H
   stream and our references are dropped, so the caching allocator gets the memory back once the copy
   has read it. A pending group whose own backward arrives before any flush simply stays on the device
   (the last layer of the chunk that turns around first);
4. backward, at the commit's backward: the group's storages are reloaded (unless prefetched), the compute
   stream waits for them, and the previous group's reload is started (prefetch);
5. backward, at the start's backward: the group is done and its device copies are dropped.

Offloading works on whole *storages*, and a reload rebuilds every saved view with its original offset,
sizes and strides. Views that alias one another (q, k, v of one fused projection) stay aliased, so every
kernel sees the very layout it saw in forward and results are bitwise identical.
"""

from __future__ import annotations

import logging
import weakref
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

import torch

from mcore_offload.runtime.base import HandlerBase
from mcore_offload.runtime.prefetch import Prefetch
from mcore_offload.runtime.saved import (
    MIN_STORAGE_COVERAGE,
    ROUTED_POINTS,
    Entry,
    Group,
    SavedRef,
    covers,
    held_elsewhere,
    routed_key,
)
from mcore_offload.runtime.second_look import SecondLook
from mcore_offload.runtime.transport import transport_for

if TYPE_CHECKING:
    from mcore_offload.runtime.manager import OffloadManager

logger = logging.getLogger(__name__)

_Tensor, _strided = torch.Tensor, torch.strided  # module globals: read once per saved tensor


class ChunkOffloadHandler(SecondLook, Prefetch, HandlerBase):
    """Offloads the saved activations of one model chunk (``vp_stage``) for one microbatch."""

    # The attributes the C++ runtime reads and writes, as slots: it reads them with one load (native/member_slots.cpp)
    # instead of a generic attribute lookup, some 90 times a layer-microbatch. Others stay in the instance dict.
    __slots__ = ("manager", "vp_stage", "microbatch", "device", "device_index", "min_numel", "not_offloadable",
                 "transport", "summary", "config", "enabled_points", "groups", "pending", "opened", "live",
                 "groups_done", "backward_started", "finished", "layers", "reload_bursts", "marks", "held_back",
                 "looking_again", "current_group")

    def __init__(
        self,
        manager: OffloadManager,
        vp_stage: int | None,
        microbatch: int,
        device: torch.device,
        min_numel: int,
        not_offloadable: set[int],
    ) -> None:
        # TE's constructors create two CUDA streams per handler and a layer-window schedule; we share one
        # transport (streams + pinned pool) per device across handlers, so they are deliberately not run.
        self.manager = manager
        self.vp_stage = vp_stage
        self.microbatch = microbatch
        self.device = device
        # what Tensor.get_device() answers for tensors on ``device`` (-1 on the CPU)
        self.device_index = device.index if device.index is not None else (
            torch.cuda.current_device() if device.type == "cuda" else -1)
        self.min_numel = min_numel
        self.not_offloadable = not_offloadable
        self.transport = transport_for(device)
        self.summary = manager.summary  # the hooks add their host time to it (one attribute hop, not two)
        self.config: Any = None  # the chunk's TransformerConfig and the points it enables (set by the manager)
        self.enabled_points: frozenset[str] = frozenset()
        self.groupid_reset()

    # ----------------------------------------------------------------------------------------- state
    def groupid_reset(self) -> None:
        """Forget every group (TE's name for it)."""
        self.groups: list[Group] = []  # committed, in commit order
        self.pending: list[Group] = []
        # every group opened; an exception inside a point leaves its group uncommitted, and finish() must
        # still cut it loose (see there)
        self.opened: list[Group] = []
        self.live: dict[int, Entry] = {}  # data_ptr of a still-alive device storage -> its entry
        self.groups_done = 0  # committed groups whose backward finished
        self.backward_started = False
        self.finished = False
        self.layers = 0  # transformer layers started in this chunk's forward
        self.reload_bursts = 0  # reload bursts _prefetch started in this chunk's backward
        self.marks = None  # auto probe: clock marks of this forward (see runtime/auto.py)
        self.held_back: list[Group] = []  # see SecondLook
        # its forward's end went through Transport.end_forward (end_chunk, or else its backward's start): once a
        # chunk forward, so that the summary's forward count, the trailing warning's denominator, is not tripled
        self.forward_end_counted = False
        self.looking_again = False
        # TE attributes that inherited code may read
        self.current_group, self.tensor_count_current_group = 0, 0

    def open_group(self, name: str) -> Group:
        group = Group(name, [name], layer=self.layers)
        self.opened.append(group)
        return group

    # --------------------------------------------------------------------------------- pack / unpack
    def ineligible_reason(self, t: torch.Tensor) -> str | None:
        """Why ``t`` stays on the device (None: it may be offloaded).

        Runs for every saved tensor: the cheapest tests come first, and ``type(...) is`` replaces
        ``isinstance(t, Parameter)``, whose metaclass check is Python code.
        """
        if type(t) is not _Tensor:
            return "parameter" if isinstance(t, torch.nn.Parameter) else "tensor subclass or layout"
        if t.layout is not _strided:
            return "tensor subclass or layout"
        if t.get_device() != self.device_index:
            return "other device"
        storage = t.untyped_storage()
        # The threshold applies to the storage: grouped GEMMs save one small view per expert of a
        # single large buffer, and it is the buffer that moves.
        if storage.nbytes() < self.min_numel * t.element_size():
            return "under min_offloaded_tensor_size"
        # Only a tensor without a base is a true leaf: a view saved by ``ctx.save_for_backward`` inside a
        # custom Function (TE's grouped GEMM saves one split per expert) reports requires_grad and is_leaf.
        if t.requires_grad and t.is_leaf and t._base is None:
            return "parameter"
        # Views of parameters are recognised by their storage: inside a custom autograd Function a view
        # of an activation can report a leaf ``_base`` (TE's grouped GEMM splits did), so ``_base`` is no test.
        if storage.data_ptr() in self.not_offloadable:
            return "parameter or main_grad storage"
        if t.is_conj() or t.is_neg():
            return "lazy conj/neg view"
        if getattr(t, "offloading_activation", True) is False:  # upstream's "do not offload" mark
            return "marked not offloadable"
        return None

    def tensor_push(self, tensor: torch.Tensor, group: Group | None = None, point: str | None = None,
                    **kwargs: Any) -> Any:
        """Pack hook: keep ineligible tensors as they are, wrap eligible ones for the group (``point``: the
        offload point saving it, by default the group's first)."""
        if group is None or self.finished:
            return tensor
        t0 = perf_counter_ns()
        reason = self.ineligible_reason(tensor)
        if reason is not None:
            group.rejected[reason] = group.rejected.get(reason, 0) + 1
            out: Any = tensor
        else:
            out = SavedRef(tensor, group, point or group.name)
            group.refs.append(out)
        self.summary.runtime_ns += perf_counter_ns() - t0
        return out

    def tensor_pop(self, tensor_tag: Any, **kwargs: Any) -> torch.Tensor:
        """Unpack hook: give back the tensor, rebuilding an offloaded view on its reloaded storage.

        Never consumes the entry: ``CheckpointWithoutOutput`` reads ``ctx.saved_tensors`` twice.
        """
        if not isinstance(tensor_tag, SavedRef):
            return tensor_tag
        if tensor_tag.tensor is not None:
            return tensor_tag.tensor
        t0 = perf_counter_ns()
        view = self._rebuild(tensor_tag)
        self.summary.runtime_ns += perf_counter_ns() - t0
        return view

    def _rebuild(self, tensor_tag: SavedRef) -> torch.Tensor:
        entry = tensor_tag.entry
        storage = entry.device_storage
        if storage is None and entry.reloaded_ref is not None:
            # Read again after every view had been read once (CheckpointWithoutOutput reads its inputs in the
            # recompute and in backward): still there while an earlier view holds it.
            storage = entry.reloaded_ref()
        if storage is None:
            if entry.host is None:
                raise RuntimeError(
                    f"mcore-offload: a tensor saved at point {entry.point!r} was read after its chunk "
                    "finished backward; this is a bug, please report it with the model configuration."
                )
            logger.debug("inline reload of a %s storage (%d bytes)", entry.point, entry.nbytes)
            self._reload([entry], on_demand=True)
            storage = entry.device_storage
        if not entry.compute_waited:
            self.transport.wait_reload(entry.h2d_event, entry.h2d_seq)
            entry.compute_waited = True
        view = torch.empty(0, dtype=tensor_tag.dtype, device=self.device)
        view.set_(storage, tensor_tag.offset, tensor_tag.size, tensor_tag.stride)
        if not tensor_tag.unpacked:
            self._first_read(tensor_tag, entry)
        return view

    @staticmethod
    def _first_read(ref: SavedRef, entry: Entry) -> None:
        """The first read of an offloaded view (native: hooks.cpp's first_read). Once every saved view of the storage
        has been read, the entry's reference becomes weak: autograd holds each view for as long as its node needs it,
        so the storage goes when its last reader is done, as it would without offloading. Held until the group's
        end, it outlived its use inside groups of several autograd nodes (the local spec's attention: the
        probabilities and the dropout mask during the softmax's and the QK product's backward)."""
        ref.unpacked = True
        entry.awaiting -= 1
        if entry.awaiting == 0 and entry.device_storage is not None:
            entry.reloaded_ref = weakref.ref(entry.device_storage)
            entry.device_storage = None

    # ---------------------------------------------------------------------------------------- forward
    def on_group_commit_forward(self, group: Group | None = None) -> None:
        """The point's forward is complete: the group waits for the next flush."""
        if group is None or group.committed or self.finished:
            return
        group.committed = True
        if group.refs:
            group.index = len(self.groups)
            self.groups.append(group)
            self.pending.append(group)
        self.current_group += 1

    def flush(self) -> None:
        """Start D2H for every pending group and drop our device references (TE: bulk offload)."""
        groups, self.pending = self.pending, []
        if not groups or self.finished:
            return
        self._copy_out(groups)

    def _copy_out(self, groups: list[Group]) -> None:
        """Copy every storage the groups' refs still hold that is worth moving and held by nothing else."""
        manager = self.manager
        native = manager.native  # the C++ helpers (runtime/native), or None
        probing = manager.auto is not None and manager.auto.plan is None
        if native is not None and manager.offload_log is None and not probing:
            # all of the below in C++ (copy_path.cpp: copy_out), for a step that neither audits nor probes
            native.copy_out(self, groups, ROUTED_POINTS, MIN_STORAGE_COVERAGE)
            return
        if native is not None:
            by_storage, attach = native.storages_of(groups), native.attach
        else:
            attach = self._attach
            by_storage: dict[int, tuple[torch.UntypedStorage, list[SavedRef]]] = {}
            for group in groups:
                for ref in group.refs:
                    if ref.tensor is not None:
                        st = ref.tensor.untyped_storage()
                        by_storage.setdefault(st.data_ptr(), (st, []))[1].append(ref)
        to_copy: list[tuple[int, torch.UntypedStorage, list[SavedRef]]] = []
        for ptr, (st, refs) in by_storage.items():
            entry = self.live.get(ptr)
            if entry is not None:  # already offloaded by an earlier group of this chunk
                attach(entry, refs)
                continue
            if len(refs) == 1:  # the common case, without the set of distinct views (and no local
                # name for the tensor: held_elsewhere counts Python references)
                if refs[0].tensor.numel() * refs[0].tensor.element_size() < MIN_STORAGE_COVERAGE * st.nbytes():
                    continue
            elif not covers(refs, MIN_STORAGE_COVERAGE * st.nbytes()):
                continue
            if held_elsewhere(st, refs):
                # Another live tensor (a residual, a mask shared by all layers, a tensor saved outside
                # the group) keeps the storage: copying it would free nothing.
                self.on_held(refs[0].point, st.nbytes(), refs)
                continue
            to_copy.append((ptr, st, refs))
        if not to_copy:
            return
        hosts, event = self.transport.to_host([st for _, st, _ in to_copy], [refs[0].tensor for _, _, refs in to_copy],
                                              [routed_key(refs[0].point) for _, _, refs in to_copy])
        for (ptr, st, refs), host in zip(to_copy, hosts):
            entry = Entry(point=refs[0].point, nbytes=st.nbytes(), host=host, d2h_event=event, device_ptr=ptr)
            entry.storage_ref = weakref.ref(st, self._released_callback(ptr, entry))
            self.live[ptr] = entry
            self.manager.on_offloaded(entry)
            auto = self.manager.auto
            if auto is not None and auto.plan is None:
                if auto.measuring:
                    auto.offloaded(self.vp_stage, self.microbatch, refs[0].group.layer, entry.point, entry.nbytes)
                elif auto.tracing_peak:
                    entry.peak_key = (self.vp_stage, refs[0].group.layer, entry.point)
            attach(entry, refs)

    def _released_callback(self, ptr: int, entry: Entry):
        def released(_: object) -> None:
            if self.live.get(ptr) is entry:
                del self.live[ptr]
            self.manager.on_released(entry, during_forward=not self.backward_started)

        return released

    @staticmethod
    def _attach(entry: Entry, refs: list[SavedRef]) -> None:
        for ref in refs:
            t = ref.tensor
            ref.dtype, ref.offset = t.dtype, t.storage_offset()
            ref.size, ref.stride = t.shape, t.stride()  # torch.Size and a tuple: immutable, kept as they are
            ref.entry, ref.tensor = entry, None
            entry.awaiting += 1
            if entry not in ref.group.entries:
                ref.group.entries.append(entry)
                entry.users += 1

    def bulk_offload_group(self, group_to_offload: Any = None) -> None:
        """TE's name: offload what is pending."""
        self.flush()

    # --------------------------------------------------------------------------------------- backward
    def on_group_commit_backward(self, group: Group | None = None) -> None:
        """Backward reached the group: make its storages resident and prefetch the previous group."""
        if group is None or self.finished:
            return
        native = self.manager.native
        if native is not None and native.commit_backward(self, group):  # the common case in C++ (backward.cpp)
            return
        if self.marks is not None:  # the auto probe's measured step: the backward's own exposure
            self.marks.backward_group(group.layer, self.device)
        self.manager.on_backward(self)
        if not self.backward_started:
            self.backward_started = True
            for g in self.pending:  # backward came before any flush: these never leave the device
                g.kept_on_device = True
                self.manager.on_kept(g)
                if self.manager.auto is not None:
                    for point in g.points:
                        self.manager.auto.kept(self.vp_stage, g.layer, point)
            self.pending = []
        self._upper_layer_done_first(group)
        self._reload(*self._chain_parts(group, group.entries), on_demand=True)
        self._wait_for_start(group)
        self._prefetch(group)
        self.current_group = max(self.current_group - 1, 0)
        self._release_refs(group)

    @staticmethod
    def _release_refs(group: Group) -> None:
        """Backward reached the group: nothing copies its tensors out any more (a flush or a second look), so the
        group lets go of its saved refs (native: saved_ref.cpp's release_refs). Autograd holds each ref for as long as
        its node needs it, so a tensor kept on the device (the chunk's last layer, a storage another tensor held at
        the flush) now goes when its last reader is done, as without offloading; the group used to keep the whole
        last layer's saved tensors through the rest of the chunk's backward. Those that still hold a tensor are kept
        weakly in ``let_go``: after a fault in backward, the abandoned graph's unread refs and their saved outputs
        form cycles through autograd that only :meth:`finish`'s abort can cut."""
        group.let_go.extend(weakref.ref(r) for r in group.refs if r.tensor is not None)
        group.refs.clear()

    def _wait_for_start(self, group: Group) -> None:
        """The compute stream's one wait before the group's backward: on the latest reload burst it needs (it covers
        the earlier ones). A split chain's first point (:meth:`Prefetch._chain_parts`) is not needed at the start:
        its entries in a later burst are waited for at their first unpack (:meth:`_rebuild`)."""
        first = group.points[0] if len(group.points) > 1 and self.manager.split_chains else None
        latest = None
        for entry in group.entries:
            if not entry.compute_waited and entry.point != first:
                if latest is None or entry.h2d_seq > latest.h2d_seq:
                    latest = entry
        if latest is None:  # nothing but the first point's: wait for those
            first = None
            for entry in group.entries:
                if not entry.compute_waited and (latest is None or entry.h2d_seq > latest.h2d_seq):
                    latest = entry
        if latest is None:
            return
        for entry in group.entries:
            if not entry.compute_waited and (first is None or entry.h2d_seq <= latest.h2d_seq):
                entry.compute_waited = True
        self.transport.wait_reload(latest.h2d_event, latest.h2d_seq)

    def bulk_reload_group(self, group_to_reload: Any) -> None:
        """TE's name: start the reload of one group."""
        self._reload(group_to_reload.entries)

    def on_chunk_backward_start(self) -> None:
        """The gradient of the chunk's output arrived: start reloading its last layer's groups now.

        No earlier group's backward prefetches them, so without this their reload would start at their own
        commit, after the layer's MLP backward, and the compute stream would wait for most of it (under
        pipeline parallelism every chunk's last layer is offloaded while other chunks run forward).
        """
        if self.finished or not self.groups:
            return
        self.manager.on_backward(self)
        last = self.groups[-1].layer
        for group in reversed(self.groups):  # in backward order, one burst each: the first needed waits least
            if group.layer != last:
                break
            self._reload(*self._chain_parts(group, group.entries))  # pending groups have none: they stay

    def on_group_backward_done(self, group: Group) -> None:
        """The group's whole backward ran: its device copies can go."""
        if group.done:
            return
        native = self.manager.native
        if native is not None and native.group_done(self, group):  # the same in C++ (backward.cpp)
            return
        group.done = True
        if self.manager.chain is not None and self.manager.chain[1] is group:
            self.manager.chain = None  # a broken chain's group whose backward came before any flush
        for entry in group.entries:
            entry.users -= 1
            if entry.users == 0:
                entry.device_storage = None
        if group.index >= 0:  # one of self.groups (a group that saved nothing was never committed there)
            self.groups_done += 1
            if group.index > 0 and self.groups[group.index - 1].layer < group.layer and self._late(group.layer):
                self._prefetch_layer_below(group)
        if self.groups_done == len(self.groups):
            self.finish()

    def finish(self, abort: bool = False) -> None:
        """Return host buffers to the pool; the handler holds nothing afterwards (``abort``: the step failed)."""
        if self.finished:
            return
        self.finished = True
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("chunk vp=%s mb=%d finished: %d/%d groups done", self.vp_stage, self.microbatch,
                         sum(g.done for g in self.groups), len(self.groups))
        native = self.manager.native
        if native is not None and not abort:  # the same in C++ (finish_release.cpp)
            native.finish_release(self, self.transport.pool if self.transport.returns_to_pool() else None)
        else:
            self._release_all(abort)

    def _release_all(self, abort: bool = False) -> None:
        """:meth:`finish`'s work once the handler is marked finished: host buffers back, counted, every reference
        dropped."""
        seen: set[int] = set()
        freed: list[Entry] = []
        release_host = self.transport.release_host
        for group in self.groups:
            for entry in group.entries:
                if id(entry) in seen or entry.host is None:
                    continue
                seen.add(id(entry))
                # The next writer of this buffer waits for the last copy that read it.
                release_host(entry.host, entry.h2d_event)
                freed.append(entry)
        if freed:
            self.manager.on_hosts_freed(freed)  # reads off_device before the loop below
        for entry in freed:
            entry.host = None
            entry.device_storage = None
        # Drop every reference we hold: tensors kept on the device (last layer, aliased storages) must go
        # when autograd lets go of them, not when the cyclic garbage collector gets round to this handler.
        # After a fault the abandoned graph still holds our SavedRefs, and GroupStart's ctx holds the group:
        # saved tensor -> grad_fn -> ... -> GroupStart -> group -> SavedRef -> saved tensor is a cycle through
        # C++ autograd nodes that the collector cannot see, so on abort the SavedRefs let go of their tensors
        # too. (Not otherwise: a group whose commit was skipped may still be unpacked by a later backward.)
        for group in self.opened:
            if abort:
                for ref in group.refs:
                    ref.tensor = None
                for weak in group.let_go:
                    ref = weak()
                    if ref is not None:
                        ref.tensor = None
            group.refs.clear()
            group.let_go.clear()
            for entry in group.entries:
                entry.storage_ref = None
            group.entries.clear()
        self.groups, self.pending, self.opened = [], [], []
        self.live.clear()
        self.manager.on_handler_finished(self)
