"""When backward brings a chunk's groups back from the host: the handler's reload bursts and prefetch (a mixin of
``ChunkOffloadHandler``).

A group's commit in backward makes its own storages resident and starts the reload of what comes next in backward:
every earlier group of its layer and the layer below (the nearest one with groups), in one burst
(:meth:`Prefetch._prefetch`). One group ahead is too little (attn_proj's backward is far shorter than core
attention's link time); a layer ahead mirrors forward, where a layer's storages stay on the device until the next
layer's copy-out has read them. The exception is the
last layer of a chunk that came back from the host under pipeline parallelism, where the rank's peak is reached:
there the layer below waits until that layer's backward is done (:meth:`Prefetch._late`, ``MCORE_OFFLOAD_PREFETCH``).
The C++ commit (``runtime/native/backward.cpp``) calls these methods by name, and does ``_prefetch``'s and
``_layer_below``'s work itself where it can.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcore_offload.runtime.saved import Entry, Group


class Prefetch:
    """ChunkOffloadHandler's reloads and prefetch (see the module docstring). The handler provides ``manager``,
    ``groups``, ``reload_bursts``, ``transport`` and ``device``."""

    manager: Any
    groups: list[Group]
    reload_bursts: int
    transport: Any
    device: Any

    def _reload(self, *runs: list[Entry], on_demand: bool = False) -> None:
        """One reload burst for what is on the host only in ``runs`` (lists of entries, in the order needed; each run
        gets its own done event)."""
        native = self.manager.native
        if native is not None and not self.manager.summary.traces_plain_peak:  # the same in C++ (native/reload.cpp)
            native.reload(self, runs, on_demand)
            return
        seen: set[int] = set()
        todo: list[Entry] = []
        parts: list[int] = []
        for run in runs:
            before = len(todo)
            for e in run:  # groups that save views of one storage share its entry
                if e.device_storage is None and e.host is not None and id(e) not in seen:
                    seen.add(id(e))
                    todo.append(e)
            if len(todo) > before:
                parts.append(len(todo) - before)
        if not todo:
            return
        self.manager.before_reload(todo)
        transport = self.transport
        storages, events = transport.to_device([e.host for e in todo], [e.nbytes for e in todo],
                                               [e.d2h_event for e in todo], self.device,
                                               parts if len(parts) > 1 else None)
        i = 0
        for part, event in zip(parts if len(parts) > 1 else [len(todo)], events):
            transport.reload_seq += 1
            seq = transport.reload_seq
            for entry in todo[i:i + part]:
                entry.device_storage, entry.h2d_event, entry.h2d_seq = storages[i], event, seq
                entry.compute_waited = False
                self.manager.on_reloaded(entry, on_demand)
                i += 1


    def _prefetch(self, group: Group) -> None:
        """Start the reload of every earlier group of this layer and of the layer before, in one batch.

        One group ahead is not enough: attn_proj's backward is far shorter than the link time of
        core_attn's storages. A layer ahead mirrors forward, where a layer's storages stay on the device
        until the next layer's copy-out has read them.

        With ``MCORE_OFFLOAD_RELOAD_LAYERS=k`` > 1 (default 1), a burst started because that layer is not
        resident also takes the k - 1 layers below it: every burst costs the same few CUDA calls whatever it
        carries, and each layer gets its own done event, so a layer still waits for its own copies only. The
        cost is memory: up to k layers' storages are back ahead of their backward (C all-five's peak rose 76 MiB
        on the H100 with k = 2). A chunk's first burst always carries one layer: it runs while backward's memory
        is at its highest.
        """
        if group.index <= 0:
            return
        late = self._late(group.layer)
        reach = group.layer if late else self._layer_below(group)
        by_group = self._on_host_down_to(group, reach)
        if not by_group:
            return
        # A late reload runs just before its first group's backward: each group gets its own done event, so that
        # backward waits for its own copies only. Ahead of time, one per layer (one event less to record).
        runs = by_group if late else [[e for run in by_group for e in run]]
        k = self.manager.reload_layers
        if k > 1 and self.reload_bursts and not late:
            layer = reach
            for prev in reversed(self.groups[: group.index]):
                if prev.layer >= reach:
                    continue
                if prev.layer <= reach - k:
                    break
                if prev.layer != layer:
                    layer = prev.layer
                    runs.append([])
                runs[-1].extend(prev.entries)  # _reload skips what is resident or shared
        self.reload_bursts += 1
        self._reload(*runs)

    def _layer_below(self, group: Group) -> int:
        """The nearest layer under ``group``'s that has groups: the next one backward needs. It is the layer right
        below unless a plan left layers out (``auto``), where stopping there would leave the layer under the gap to
        reload on demand (session 69, B: half the plan's reloads, 9.8 ms of stall a step)."""
        for prev in reversed(self.groups[: group.index]):
            if prev.layer < group.layer:
                return prev.layer
        return group.layer - 1

    def _late(self, layer: int) -> bool:
        """Whether the layer below ``layer`` reloads only once ``layer``'s backward is done (MCORE_OFFLOAD_PREFETCH).

        ``layer``: when ``layer``'s backward starts, so the reload hides behind the whole backward of ``layer``'s
        attention and of the MLP below. ``late``: always at the end (upstream's moment), behind that MLP backward
        only: the device never holds two layers' groups at once. ``tail`` (default): late in the last layer of a
        chunk that came back from the host (it did not turn around), ``layer`` everywhere else. Under pipeline
        parallelism the step's peak is reached there, in the first attention backward of a chunk that waited while
        other chunks ran forward (allocator trace, 2x H200, PP=2 x VPP=2, session 15): ``tail`` raised D-dense's
        Δpeak on rank 0 from 864 to 912 MiB with ``core_attn`` (upstream's 912) and from 1648 to 1744 MiB with the
        attention set (upstream's 1792), for 0 and about 6 ms more reload stall per step. A chunk that turns around
        (no pipelining, the last stage) keeps its last layer on the device: nothing changes there.
        """
        mode = self.manager.prefetch
        if mode == "layer":
            return False
        if mode == "late":
            return True
        last = self.groups[-1]
        return layer == last.layer and not last.kept_on_device

    def _on_host_down_to(self, group: Group, reach: int) -> list[list[Entry]]:
        """The entries still only on the host of the groups before ``group``, back to layer ``reach``: one list per
        group that has any, in backward order."""
        needed: list[list[Entry]] = []
        for prev in reversed(self.groups[: group.index]):
            if prev.layer < reach:
                break
            if not prev.done:
                run = [e for e in prev.entries if e.device_storage is None and e.host is not None]
                if run:
                    needed.extend(self._chain_parts(prev, run))
        return needed

    def _chain_parts(self, group: Group, run: list[Entry]) -> list[list[Entry]]:
        """``run`` (entries of ``group``) as the reload parts backward needs one after the other: a chain's later
        points' storages, then its first point's (``split_chains``, ``MCORE_OFFLOAD_SPLIT_CHAINS``).

        A chain's backward runs its points last to first, so its first point's storages (qkv_linear's input in
        the attention chain) are needed last. In their own part, with their own done event, they arrive behind
        the later points' backward where a reload runs late (the ``tail`` moment, a chunk's backward start) instead
        of holding up its start: :meth:`ChunkOffloadHandler.on_group_commit_backward` waits for the later part
        only, and the first point's part is waited for at its first unpack. Same bytes at the same moments, so
        memory does not change.
        """
        if len(group.points) < 2 or not self.manager.split_chains:
            return [run]
        first = group.points[0]
        later = [e for e in run if e.point != first]
        if not later or len(later) == len(run):
            return [run]
        return [later, [e for e in run if e.point == first]]

    def _upper_layer_done_first(self, group: Group) -> None:
        """Before ``group`` reloads on its own: if the next group up is the first of a later layer whose prefetch is
        late and it is not done yet, it is done now, and its late burst brings this layer back first.

        Why: a point committed at the layer's output (``mlp_norm``, after the bias-dropout-add) hooks the node that
        made the output, and so does the next layer's first point where it starts from that tensor (TE's fused
        ``qkv_linear``, or ``attn_norm``). Pre-hooks run in the order they were added, so this group's commit ran
        before the layer above was marked done, and reloaded on demand ahead of the late burst (D-moe's probe steps,
        sessions 69-70: ``mlp_norm`` of each chunk's first layer, 128 MiB a chunk). The layer above is through by
        now in any case: this node runs only once its input's gradient is complete.
        """
        i = group.index
        if i < 0 or i + 1 >= len(self.groups):
            return
        upper = self.groups[i + 1]
        if upper.layer > group.layer and not upper.done and self._late(upper.layer):
            self.on_group_backward_done(upper)

    def _prefetch_layer_below(self, group: Group) -> None:
        """The layer's first group is done (a late prefetch, see :meth:`_late`): its storages go as the layer
        below's come back, one done event per group. The layer below's backward starts right away, so its first
        group (a MoE layer's experts) waits only for its own copies, and the rest arrive behind that backward."""
        by_group = self._on_host_down_to(group, self.groups[group.index - 1].layer)
        if by_group:
            self.reload_bursts += 1
            self._reload(*by_group)
