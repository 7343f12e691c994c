"""A second look at the storages a flush left on the device because another tensor held them.

A flush copies a storage only if nothing but the saved references holds it: copying a storage that something else
keeps alive would free nothing. Some of those holders go away before the chunk's backward. The first layer's
input is held by the model's own forward (``GPTModel.forward``'s ``decoder_input``) while the layers flush, and
by nothing but the saved reference once that forward has returned. Under pipeline parallelism the chunk then waits
for its backward while other chunks run. On D-dense's first stage (PP=2 x VPP=2) ours' Δpeak was 1744 MiB against
upstream 0.16.1's 1792 without the second look (session 38) and is 1808 with it (session 39, 2x H200): the eight
16 MiB embedding outputs of a step move, four of them off the device at the peak.

So a handler keeps the groups of every storage its flushes left for that reason, and the manager asks it to look
again once its forward has returned and before its backward starts (``OffloadManager._look_again``: as the next
chunk's forward starts, and as another chunk's backward starts). What is free by then is copied out like any
flushed storage; what is still held (an input received from the previous stage, which the schedule keeps for its
backward) stays, and is not looked at again. ``MCORE_OFFLOAD_SECOND_LOOK=0`` turns the look off (what it costs can
then be measured against it; docs/configuration.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcore_offload.runtime.saved import Group, SavedRef


class SecondLook:
    """ChunkOffloadHandler's second look (see the module docstring). The handler sets ``held_back`` (groups, in
    the order their storages were left) and ``looking_again``, and provides ``_copy_out``, ``manager``,
    ``summary``, ``finished`` and ``backward_started``."""

    held_back: list[Group]
    looking_again: bool
    manager: Any
    summary: Any
    finished: bool
    backward_started: bool

    def _copy_out(self, groups: list[Group]) -> None:  # ChunkOffloadHandler's
        raise NotImplementedError

    def on_held(self, point: str, nbytes: int, refs: list[SavedRef]) -> None:
        """A flush left a storage on the device because another tensor held it (the C++ copy-out has its twin,
        runtime/native/copy_path.cpp: on_held):
        counted as ``skipped_aliased``, and its groups kept for :meth:`second_look`."""
        if self.looking_again:  # counted at the first look
            return
        self.manager.on_skipped(point, nbytes)
        if not self.manager.second_look:  # MCORE_OFFLOAD_SECOND_LOOK=0
            return
        for ref in refs:
            if not any(g is ref.group for g in self.held_back):
                self.held_back.append(ref.group)

    def second_look(self) -> None:
        """Copy out what the flushes left because another tensor held it, where nothing else holds it now; what
        is copied no longer counts as ``skipped_aliased``."""
        groups, self.held_back = self.held_back, []
        if not groups or self.finished or self.backward_started:
            return
        before = self.summary.point_totals("offloaded")
        self.looking_again = True
        try:
            self._copy_out(groups)
        finally:
            self.looking_again = False
        for point, n in self.summary.point_totals("offloaded").items():
            moved = n - before.get(point, 0)
            if moved:
                self.summary.add(point, "skipped_aliased", -moved)
                self.manager.second_look_bytes += moved
