"""The step manager: which handler is forwarding, which handlers await backward, and the byte counters.

One handler is created per (model chunk, microbatch) when a training forward of a ``GPTModel`` starts.
Backward needs no schedule model: every GroupCommit / GroupStart autograd node carries its own handler,
so handlers reach backward in exactly the order the schedule (no pipelining, 1F1B or interleaved) runs
them, whatever the number of microbatches. The manager only decides *when* a handler's last layer is
flushed: when another chunk's forward or backward comes first.
"""

from __future__ import annotations

import logging
from time import perf_counter_ns
from typing import Any

import torch

from mcore_offload.runtime.handler import ChunkOffloadHandler, Entry, Group
from mcore_offload.runtime.transport import reset_transports
from mcore_offload.summary import OffloadSummary

logger = logging.getLogger(__name__)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward (recompute inside backward must not offload)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def point_enabled(config: Any, name: str | None) -> bool:
    return (
        name is not None
        and getattr(config, "fine_grained_activation_offloading", False)
        and name in (config.offload_modules or ())
    )


class OffloadManager:
    """Per-process offload state. :func:`get_manager` gives the instance; :meth:`reset` clears it."""

    def __init__(self) -> None:
        self.summary = OffloadSummary()
        self._announced: set[str] = set()
        self.reset_step()

    def reset_step(self) -> None:
        self.handlers: list[ChunkOffloadHandler] = []
        self.forward_handler: ChunkOffloadHandler | None = None
        # groups whose ``offload`` block closed and whose ``commit`` has not come yet
        self.open_groups: dict[tuple[int, str], Group] = {}
        self._microbatches: dict[int | None, int] = {}

    # ------------------------------------------------------------------------------- forward side
    def begin_chunk(self, config: Any, vp_stage: int | None, model: torch.nn.Module) -> None:
        """A model chunk's forward starts: open a handler if this is a training forward."""
        t0 = perf_counter_ns()
        try:
            self._begin_chunk(config, vp_stage, model)
        finally:
            self.summary.runtime_ns += perf_counter_ns() - t0

    def _begin_chunk(self, config: Any, vp_stage: int | None, model: torch.nn.Module) -> None:
        if self.forward_handler is not None:
            self.forward_handler.flush()
        self.forward_handler = None
        self.open_groups.clear()
        if not getattr(config, "fine_grained_activation_offloading", False):
            return
        if not model.training or not torch.is_grad_enabled() or _in_backward():
            return
        params = list(model.parameters())
        if not params:
            return
        protected = {p.untyped_storage().data_ptr() for p in params}
        protected |= {
            p.main_grad.untyped_storage().data_ptr()
            for p in params
            if getattr(p, "main_grad", None) is not None
        }
        mb = self._microbatches.get(vp_stage, 0)
        self._microbatches[vp_stage] = mb + 1
        handler = ChunkOffloadHandler(
            self, vp_stage, mb, params[0].device, int(config.min_offloaded_tensor_size), protected
        )
        self.handlers.append(handler)
        self.forward_handler = handler

    def handler_for(self, config: Any, name: str | None) -> ChunkOffloadHandler | None:
        """The handler an offload point should use now, or None when the point is off."""
        handler = self.forward_handler
        if handler is None or not point_enabled(config, name):
            return None
        if not torch.is_grad_enabled() or _in_backward():
            return None
        return handler

    def layer_boundary(self) -> None:
        """A transformer layer starts: the previous layer's groups may leave the device."""
        handler = self.forward_handler
        if handler is not None and not _in_backward():
            t0 = perf_counter_ns()
            handler.layers += 1
            handler.flush()
            self.summary.runtime_ns += perf_counter_ns() - t0

    def group_closed(self, group: Group) -> None:
        if not group.refs and group.name not in self._announced:
            self._announced.add(group.name)
            why = ", ".join(f"{n} {r}" for r, n in sorted(group.rejected.items())) or "none saved"
            logger.info(
                "offload point %s saved no tensor that can be offloaded here (%s); with the "
                "TransformerEngine spec attn_norm/mlp_norm are fused into the next linear",
                group.name,
                why,
            )

    # ------------------------------------------------------------------------------ backward side
    def on_backward(self, handler: ChunkOffloadHandler) -> None:
        """A handler's backward is running: the chunk still forwarding-pending must flush first."""
        fwd = self.forward_handler
        if fwd is not None and fwd is not handler and fwd.pending:
            fwd.flush()

    def on_handler_finished(self, handler: ChunkOffloadHandler) -> None:
        if handler in self.handlers:
            self.handlers.remove(handler)
        if self.forward_handler is handler:
            self.forward_handler = None

    def end_step(self, aborted: bool = False) -> None:
        """End of a schedule call (training or forward-only, normal or by exception): leave no state."""
        leftovers = [h for h in self.handlers if not h.finished]
        if aborted and leftovers:
            logger.warning("step aborted: dropping offload state of %d chunk(s)", len(leftovers))
            for h in leftovers:
                h.transport.synchronize()
        for h in leftovers:
            h.finish()
        if self.summary.step_has_activity():
            self.summary.close_step(aborted=aborted)
        self.reset_step()

    # ------------------------------------------------------------------------------------ counters
    def on_offloaded(self, entry: Entry) -> None:
        self.summary.add(entry.point, "offloaded", entry.nbytes)
        self.summary.host_resident(+entry.nbytes)

    def on_released(self, entry: Entry, during_forward: bool) -> None:
        self.summary.add(entry.point, "released_in_forward" if during_forward else "released_late",
                         entry.nbytes)
        if entry.host is not None and entry.device_storage is None:
            entry.off_device = True
            self.summary.off_device(+entry.nbytes)

    def on_reloaded(self, entry: Entry) -> None:
        self.summary.add(entry.point, "reloaded", entry.nbytes)
        self._back_on_device(entry)

    def on_host_freed(self, entry: Entry) -> None:
        self.summary.host_resident(-entry.nbytes)
        self._back_on_device(entry)  # an aborted step never reloads: the bytes are simply gone

    def _back_on_device(self, entry: Entry) -> None:
        if entry.off_device:
            entry.off_device = False
            self.summary.off_device(-entry.nbytes)

    def on_skipped(self, point: str, nbytes: int) -> None:
        self.summary.add(point, "skipped_aliased", nbytes)

    def on_kept(self, group: Group) -> None:
        nbytes = sum(r.tensor.numel() * r.tensor.element_size() for r in group.refs
                     if r.tensor is not None)
        self.summary.add(group.name, "kept_on_device", nbytes)


_MANAGER: OffloadManager | None = None


def get_manager() -> OffloadManager:
    global _MANAGER
    if _MANAGER is None:
        _MANAGER = OffloadManager()
    return _MANAGER


def reset() -> None:
    """Forget all offload state, counters, streams and host buffers (tests; between independent runs)."""
    global _MANAGER
    if _MANAGER is not None:
        _MANAGER.end_step(aborted=True)
    _MANAGER = None
    reset_transports()
