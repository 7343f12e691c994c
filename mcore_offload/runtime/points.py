"""The API the megatron-core patch hunks call. Each patched module imports this module as
``_mcore_offload_points``; that import is also the marker ``mcore_offload.patching.sites`` looks for.

- ``offload(name, config, tensor)``: context manager around the computation of an offload point. The
  tensor entering it goes through :class:`GroupStart` (identity; its backward marks the group done) and the
  tensors saved for backward inside go to the chunk's handler through saved-tensor hooks.
- ``commit(name, config, value)``: after the point's output is final (for the norms: after the bias-dropout-
  add that still reads the residual), route it through :class:`GroupCommit` (identity; its forward queues
  the group for offload, its backward brings the group back before the group's own backward runs).
- ``begin_chunk`` (GPTModel.forward), ``layer_boundary`` (TransformerLayer.forward) and ``step_boundary``
  (the three pipeline schedules) drive the manager.

Every function is a cheap no-op unless offloading is enabled for that point and this is a training forward.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any, TypeVar

import torch

from mcore_offload.runtime import manager as _manager_module
from mcore_offload.runtime.handler import ChunkOffloadHandler, Group
from mcore_offload.runtime.manager import get_manager

F = TypeVar("F", bound=Callable[..., Any])

# The C entry of ``Function.apply``: the Python wrapper in front of it (functorch checks, setup_context
# lookup) costs as much again as the node itself, twice per group on a launch-bound path. Our functions
# never run under functorch transforms (offloading is off inside them: no training forward).
_c_apply = getattr(getattr(torch._C, "_FunctionBase", None), "__dict__", {}).get("apply")


def _fast_apply(fn: type[torch.autograd.Function]) -> Callable[..., Any]:
    return _c_apply.__get__(None, fn) if _c_apply is not None else fn.apply


class GroupStart(torch.autograd.Function):
    """Identity at the entry of an offload point; backward: the group's backward is complete."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, handler: ChunkOffloadHandler, group: Group):
        ctx.handler, ctx.group = handler, group
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        t0 = perf_counter_ns()
        ctx.handler.on_group_backward_done(ctx.group)
        ctx.handler.manager.summary.runtime_ns += perf_counter_ns() - t0
        return grad, None, None


class GroupCommit(torch.autograd.Function):
    """Identity at the end of an offload point; forward queues the group, backward reloads it."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, handler: ChunkOffloadHandler, group: Group):
        handler.on_group_commit_forward(group)
        ctx.handler, ctx.group = handler, group
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        t0 = perf_counter_ns()
        ctx.handler.on_group_commit_backward(ctx.group)
        ctx.handler.manager.summary.runtime_ns += perf_counter_ns() - t0
        return grad, None, None


_start = _fast_apply(GroupStart)
_commit_node = _fast_apply(GroupCommit)


class _Passthrough:
    """The context of a point that is off: hands the tensor through (cheaper than a generator context)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __enter__(self) -> Any:
        return self.tensor

    def __exit__(self, *exc: Any) -> None:
        return None


def offload(name: str | None, config: Any, tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Offload what is saved for backward inside this block (see the module docstring)."""
    manager = _manager_module._MANAGER
    # no forward handler: not a training forward, or offloading is off (the common case: a cheap exit)
    if manager is None or manager.forward_handler is None:
        return _Passthrough(tensor)
    forward = manager.forward_handler
    if config is forward.config and name not in forward.enabled_points:  # a point this config never enables
        return _Passthrough(tensor)
    handler = manager.handler_for(config, name)
    if handler is None or not isinstance(tensor, torch.Tensor):
        return _Passthrough(tensor)
    return _OffloadBlock(manager, handler, name, tensor)


class _OffloadBlock:
    """The context of a point that is on (a class, not a generator context: it runs once per group and layer)."""

    __slots__ = ("manager", "handler", "name", "tensor", "group", "hooks")

    def __init__(self, manager: Any, handler: ChunkOffloadHandler, name: str, tensor: torch.Tensor) -> None:
        self.manager, self.handler, self.name, self.tensor = manager, handler, name, tensor

    def __enter__(self) -> torch.Tensor:
        t0 = perf_counter_ns()
        handler, tensor = self.handler, self.tensor
        self.tensor = None  # the block does not keep the input alive
        group = self.group = handler.open_group(self.name)
        if tensor.requires_grad:
            tensor = _start(tensor, handler, group)

        def pack(saved: torch.Tensor) -> Any:
            return handler.tensor_push(saved, group)

        self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, handler.tensor_pop)
        self.hooks.__enter__()
        self.manager.summary.runtime_ns += perf_counter_ns() - t0
        return tensor

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        t0 = perf_counter_ns()
        self.hooks.__exit__(exc_type, exc, tb)
        if exc_type is None:  # a block that raised leaves its group uncommitted (finish() cuts it loose)
            self.manager.open_groups[self.name] = (self.handler, self.group)
            self.manager.group_closed(self.group)
        self.manager.summary.runtime_ns += perf_counter_ns() - t0


def commit(name: str | None, config: Any, value: Any) -> Any:
    """Mark the end of point ``name``; ``value`` is a tensor or a tuple/list whose first item is one."""
    manager = _manager_module._MANAGER
    # Only a point whose offload block registered a group has anything to do here (cheap exit for the rest).
    if name is None or manager is None or name not in manager.open_groups:
        return value
    handler = manager.handler_for(config, name)
    if handler is None:
        return value
    t0 = perf_counter_ns()
    try:
        return _commit(manager, handler, name, value)
    finally:
        manager.summary.runtime_ns += perf_counter_ns() - t0


def _commit(manager: Any, handler: ChunkOffloadHandler, name: str, value: Any) -> Any:
    opened_by, group = manager.open_groups.pop(name)
    if opened_by is not handler:  # opened by a chunk whose forward has ended
        return value
    is_sequence = isinstance(value, (tuple, list))
    tensor = value[0] if is_sequence else value
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        tensor = _commit_node(tensor, handler, group)
    else:  # nothing for backward to hook: the group is still queued for offload
        handler.on_group_commit_forward(group)
    return type(value)((tensor, *value[1:])) if is_sequence else tensor


def begin_chunk(config: Any, vp_stage: int | None, model: torch.nn.Module) -> None:
    """Called by ``GPTModel.forward``: a model chunk (``vp_stage``) starts a forward."""
    if getattr(config, "fine_grained_activation_offloading", False):
        get_manager().begin_chunk(config, vp_stage, model)


def layer_boundary(config: Any) -> None:
    """Called at the top of ``TransformerLayer.forward``."""
    if getattr(config, "fine_grained_activation_offloading", False):
        get_manager().layer_boundary()


def step_boundary(schedule: F) -> F:
    """Decorates megatron-core's schedule functions: end-of-step reset, even when the step raises."""

    @functools.wraps(schedule)
    def run_schedule(*args: Any, **kwargs: Any) -> Any:
        completed = False
        try:
            result = schedule(*args, **kwargs)
            completed = True
            return result
        finally:
            get_manager().end_step(aborted=not completed)

    return run_schedule


def mark_not_offloadable(*tensors: torch.Tensor | None) -> None:
    """Keep these tensors on the device whatever point saves them (upstream's attribute convention)."""
    for t in tensors:
        if t is not None:
            t.offloading_activation = False
