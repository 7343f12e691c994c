"""The API the megatron-core patch hunks call. Each patched module imports this module as
``_mcore_offload_points``; that import is also the marker ``mcore_offload.patching.sites`` looks for.

- ``offload(name, config, tensor)``: context manager around the computation of an offload point. The
  tensor entering it goes through :class:`GroupStart` (identity; its backward marks the group done) and the
  tensors saved for backward inside go to the chunk's handler through saved-tensor hooks.
- ``commit(name, config, value)``: after the point's output is final (for the norms: after the bias-dropout-
  add that still reads the residual), route it through :class:`GroupCommit` (identity; its forward queues
  the group for offload, its backward brings the group back before the group's own backward runs).

Where the tensor already has a ``grad_fn``, GroupStart's and GroupCommit's backward run as pre-hooks on that
node instead of as identity nodes of their own (:class:`StartHook`, :class:`CommitHook`): the node that made the
point's input runs once the point's whole backward has produced its gradient, and the node that made its output
runs before any of the point's nodes. The same moments, with no extra node: an identity ``Function.apply`` costs
about 30 µs of host time inside a launch-bound step, and its backward dispatch more, twice per group.
``MCORE_OFFLOAD_NODE_HOOKS=0`` restores the identity nodes (for comparisons).
- ``expert_loop(config)``: context manager around a SequentialMLP's loop over its local experts, whose ``commit``
  takes the concatenated output: the experts of a layer share one group (see :func:`expert_loop`).
- ``begin_chunk`` / ``end_chunk`` (GPTModel.forward, around the decoder), ``layer_boundary``
  (TransformerLayer.forward) and ``step_boundary`` (the three pipeline schedules) drive the manager.

Every function is a cheap no-op unless offloading is enabled for that point and this is a training forward.

With the C++ runtime loaded, ``offload`` and ``commit`` hand the common case (the forward chunk's own config, no
``auto``, a plain tensor) to ``runtime/native/points_block.cpp``, which does what ``_OffloadBlock`` and ``_commit`` do
here and calls back into this module for the rest; ``MCORE_OFFLOAD_NATIVE_POINTS=0`` keeps this module's glue.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any, TypeVar

import torch

from mcore_offload.runtime import manager as _manager_module
from mcore_offload.runtime.enabled import in_backward
from mcore_offload.runtime.handler import ChunkOffloadHandler
from mcore_offload.runtime.manager import get_manager
from mcore_offload.runtime.saved import MIN_STORAGE_COVERAGE, ROUTED_POINTS, Group

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


class _NodeHook:
    """GroupStart's or GroupCommit's backward as a pre-hook on an existing autograd node (see the module docstring)."""

    __slots__ = ("handler", "group")

    def __init__(self, handler: ChunkOffloadHandler, group: Group) -> None:
        self.handler, self.group = handler, group


class StartHook(_NodeHook):
    """On the node that made the point's input: it runs once that input's gradient is complete, after the point's
    whole backward, so the group is done."""

    __slots__ = ()

    def __call__(self, grad_outputs: Any = None) -> None:
        t0 = perf_counter_ns()
        self.handler.on_group_backward_done(self.group)
        self.handler.summary.runtime_ns += perf_counter_ns() - t0


class CommitHook(_NodeHook):
    """On the node that made the point's output: it runs before that node, the first of the point's backward, so
    the group is brought back now."""

    __slots__ = ()

    def __call__(self, grad_outputs: Any = None) -> None:
        t0 = perf_counter_ns()
        self.handler.on_group_commit_backward(self.group)
        self.handler.summary.runtime_ns += perf_counter_ns() - t0


_Parameter = torch.nn.Parameter
_grad_enabled = torch.is_grad_enabled
# What ``torch.autograd.graph.saved_tensors_hooks`` calls on entry and exit, without a context object of its own per
# block (the block is the context already); the wrapper where these private names are gone.
_autograd = getattr(torch._C, "_autograd", None)
_push_hooks = getattr(_autograd, "_push_saved_tensors_default_hooks", None)
_pop_hooks = getattr(_autograd, "_pop_saved_tensors_default_hooks", None)
_start = _fast_apply(GroupStart)
_commit_node = _fast_apply(GroupCommit)


def _hook_node(tensor: torch.Tensor, manager: Any, hook: _NodeHook) -> bool:
    """Run ``hook`` before the backward of the node that made ``tensor``; False where there is none (a leaf)."""
    native = manager.native
    if native is not None:  # registered in C++ (runtime/native/node_hooks.cpp): no handle, no wrapped gradients
        return native.add_prehook(tensor, hook)
    node = tensor.grad_fn
    if node is None:
        return False
    node.register_prehook(hook)
    return True


def _start_group(tensor: torch.Tensor, handler: ChunkOffloadHandler, group: Group) -> torch.Tensor:
    """The point's input, marked so that the group is done when its gradient is complete."""
    if handler.manager.node_hooks and _hook_node(tensor, handler.manager, StartHook(handler, group)):
        return tensor
    return _start(tensor, handler, group)  # a leaf has no node to hook: an identity node of our own


def _commit_group(tensor: torch.Tensor, handler: ChunkOffloadHandler, group: Group) -> torch.Tensor:
    """The point's output, marked so that the group reloads before the point's backward; queues the group."""
    if handler.manager.node_hooks and tensor.grad_fn is not None:
        handler.on_group_commit_forward(group)
        _hook_node(tensor, handler.manager, CommitHook(handler, group))
        return tensor
    return _commit_node(tensor, handler, group)


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
    native = manager.native_points
    if native is not None:  # the same in C++ (runtime/native/points_block.cpp), None where this function decides
        block = native.offload_block(manager, name, config, tensor)
        if block is not None:
            return block
    forward = manager.forward_handler
    if config is forward.config and manager.auto is None:
        # handler_for's answer for the forward chunk's own config without auto, without the call
        if name not in forward.enabled_points or not _grad_enabled() or in_backward():
            return _Passthrough(tensor)
        handler = forward
    else:
        handler = manager.handler_for(config, name)
    if handler is None or not isinstance(tensor, torch.Tensor):
        return _Passthrough(tensor)
    chain = manager.chain
    if chain is not None:
        if chain[0] is handler and chain[2] == name:  # the previous point left its group open for this one
            manager.chain = None
            return _OffloadBlock(manager, handler, name, tensor, chain[1])
        manager.close_chain()
    return _OffloadBlock(manager, handler, name, tensor)


def _python_pack(handler: ChunkOffloadHandler, group: Group, name: str) -> Callable[[torch.Tensor], Any]:
    """The pack hook of one offload block, in Python (``MCORE_OFFLOAD_NATIVE=0``, or where the C++ one cannot be
    built)."""
    push = handler.tensor_push

    def pack(saved: torch.Tensor) -> Any:
        if type(saved) is _Parameter:  # weights, half of what a grouped GEMM saves: kept, at the least cost
            group.parameters += 1
            return saved
        return push(saved, group, name)

    return pack


class _OffloadBlock:
    """The context of a point that is on (a class, not a generator context: it runs once per group and layer).

    ``joined``: the open group of the point just before in a chain; the block adds to it, without a start node.
    """

    __slots__ = ("manager", "handler", "name", "tensor", "group", "hooks", "refs_before", "rejected_before",
                 "parameters_before")
    # hooks: the saved_tensors_hooks context where torch's private push/pop are missing, else None

    def __init__(self, manager: Any, handler: ChunkOffloadHandler, name: str, tensor: torch.Tensor,
                 joined: Group | None = None) -> None:
        self.manager, self.handler, self.name, self.tensor, self.group = manager, handler, name, tensor, joined

    def __enter__(self) -> torch.Tensor:
        t0 = perf_counter_ns()
        handler, tensor, name = self.handler, self.tensor, self.name
        self.tensor = None  # the block does not keep the input alive
        group = self.group
        if group is None:
            group = self.group = handler.open_group(name)
            if tensor.requires_grad:
                tensor = _start_group(tensor, handler, group)
        elif name not in group.points:  # an expert loop's group is joined by every expert's points
            group.points.append(name)
        # what the group held before this block (a chain's group holds the earlier points' too)
        self.refs_before, self.rejected_before = len(group.refs), (dict(group.rejected) if group.rejected else {})
        self.parameters_before = group.parameters
        native = self.manager.native
        if native is not None:  # the same hooks in C++ (runtime/native/hooks.cpp)
            pack, unpack = native.Packer(handler, group, name), native.Unpacker(handler)
        else:
            pack, unpack = _python_pack(handler, group, name), handler.tensor_pop
        if _push_hooks is not None and _pop_hooks is not None:
            self.hooks = None
            _push_hooks(pack, unpack)
        else:
            self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            self.hooks.__enter__()
        self.manager.summary.runtime_ns += perf_counter_ns() - t0
        return tensor

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        t0 = perf_counter_ns()
        if self.hooks is None:
            _pop_hooks()
        else:
            self.hooks.__exit__(exc_type, exc, tb)
        if exc_type is None:  # a block that raised leaves its group uncommitted (finish() cuts it loose)
            group = self.group
            self.manager.open_groups[self.name] = (self.handler, group)
            if len(group.refs) == self.refs_before and self.name not in self.manager.announced_points:
                _saved_nothing(self.manager, self.name, group, self.rejected_before, self.parameters_before)
        self.manager.summary.runtime_ns += perf_counter_ns() - t0


def _saved_nothing(manager: Any, name: str, group: Group, rejected_before: dict[str, int],
                   parameters_before: int) -> None:
    """A block of point ``name`` ended without adding a tensor to offload: say why its saved tensors stayed (the
    C++ block calls this too)."""
    rejected = {k: n - rejected_before.get(k, 0) for k, n in group.rejected.items()}
    rejected["parameter"] = rejected.get("parameter", 0) + group.parameters - parameters_before
    manager.point_saved_nothing(name, {k: n for k, n in rejected.items() if n})


def commit(name: str | None, config: Any, value: Any) -> Any:
    """Mark the end of point ``name``; ``value`` is a tensor or a tuple/list whose first item is one."""
    manager = _manager_module._MANAGER
    # Only a point whose offload block registered a group has anything to do here (cheap exit for the rest).
    if name is None or manager is None:
        return value
    opened = manager.open_groups.get(name)
    if opened is None:
        return value
    native = manager.native_points
    if native is not None:  # the same in C++ (runtime/native/points_block.cpp), NotImplemented where this decides
        out = native.commit_point(manager, opened, name, config, value)
        if out is not NotImplemented:
            return out
    opened_by = opened[0]
    # handler_for's answer, without the call, where the block's handler is still the forward chunk's and the
    # config its own, without auto
    fast = opened_by is manager.forward_handler and config is opened_by.config and manager.auto is None
    if fast:
        handler = opened_by if name in opened_by.enabled_points and _grad_enabled() and not in_backward() else None
    else:
        handler = manager.handler_for(config, name)
    if handler is None:
        return value
    t0 = perf_counter_ns()
    try:
        return _commit(manager, handler, config, name, value, fast)
    finally:
        manager.summary.runtime_ns += perf_counter_ns() - t0


def _commit(manager: Any, handler: ChunkOffloadHandler, config: Any, name: str, value: Any, fast: bool) -> Any:
    opened_by, group = manager.open_groups.pop(name)
    if opened_by is not handler:  # opened by a chunk whose forward has ended
        return value
    follower = manager.chain_next.get(name)
    if follower is not None and manager.chaining and (
            follower in handler.enabled_points if fast else manager.handler_for(config, follower) is handler):
        # The next point of this layer is on too: it joins this group, so the pair costs one start node, one
        # commit node and one group's bookkeeping instead of two of each.
        manager.chain = (handler, group, follower)
        return value
    is_sequence = isinstance(value, (tuple, list))
    tensor = value[0] if is_sequence else value
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
        tensor = _commit_group(tensor, handler, group)
    else:  # nothing for backward to hook: the group is still queued for offload
        handler.on_group_commit_forward(group)
    return type(value)((tensor, *value[1:])) if is_sequence else tensor


EXPERT_POINTS = ("expert_fc1", "moe_act")


class _NoExpertLoop:
    """The context of an expert loop whose experts offload nothing (or ``MCORE_OFFLOAD_EXPERT_LOOP=0``)."""

    __slots__ = ()

    def __enter__(self) -> _NoExpertLoop:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def commit(self, output: Any) -> Any:
        return output


_NO_EXPERT_LOOP = _NoExpertLoop()


class _ExpertLoop:
    """The context of a SequentialMLP's loop over its local experts (see :func:`expert_loop`)."""

    __slots__ = ("manager", "loop_next", "outer_next")

    def __init__(self, manager: Any, loop_next: dict[str, str]) -> None:
        self.manager, self.loop_next = manager, loop_next

    def __enter__(self) -> _ExpertLoop:
        self.outer_next, self.manager.chain_next = self.manager.chain_next, self.loop_next
        return self

    def __exit__(self, *exc: Any) -> None:
        self.manager.chain_next = self.outer_next

    def commit(self, output: Any) -> Any:
        """The experts' concatenated output: the group the last expert left open is queued, and backward reloads it
        before the first expert backward (the cat's node runs before any of theirs)."""
        manager = self.manager
        manager.chain_next = self.outer_next  # the loop's chaining ends here (__exit__ restores it after a fault)
        chain = manager.chain
        if chain is None or chain[2] not in EXPERT_POINTS or chain[0] is not manager.forward_handler:
            return output
        t0 = perf_counter_ns()
        manager.chain = None
        handler, group = chain[0], chain[1]
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output = _commit_group(output, handler, group)
        else:
            handler.on_group_commit_forward(group)
        manager.summary.runtime_ns += perf_counter_ns() - t0
        return output


def expert_loop(config: Any) -> _ExpertLoop | _NoExpertLoop:
    """Around a SequentialMLP's loop over its local experts; ``commit`` the concatenated output inside it.

    Each expert runs the MLP's own points, so with 64 experts a layer opened 64 groups per point, each with its start
    and commit hooks, its bookkeeping and its backward calls: 60-75 µs of host time an expert, layer and microbatch on
    the H200 host (session 81). In the loop, the last point on in one expert leaves the group open for the first
    point on in the next, as a chain does within a layer, so the experts of a layer share one group, as a grouped
    GEMM's do (session 82, the same model: 25.5-43.5 ms a step against 71-80). The bytes and the moments they leave
    the device are the same (a layer's groups go at its flush). The group is done when the first expert's input node
    runs, after every expert's backward (the engine runs the later expert's nodes first, as chains within a layer
    assume); its reload starts at the cat's node, before all of them, where the experts' own groups had reloaded one
    after the other. ``MCORE_OFFLOAD_EXPERT_LOOP=0``: a group per expert, as before (for comparisons).
    """
    manager = _manager_module._MANAGER
    if manager is None or manager.forward_handler is None or not manager.chaining or not manager.expert_loop:
        return _NO_EXPERT_LOOP
    on = [p for p in EXPERT_POINTS if manager.handler_for(config, p) is not None]
    if not on:
        return _NO_EXPERT_LOOP
    # the last point on in an expert is followed by the first point on in the next one
    return _ExpertLoop(manager, {**manager.chain_next, on[-1]: on[0]})


def begin_chunk(config: Any, vp_stage: int | None, model: torch.nn.Module) -> None:
    """Called by ``GPTModel.forward``: a model chunk (``vp_stage``) starts a forward."""
    if getattr(config, "fine_grained_activation_offloading", False):
        get_manager().begin_chunk(config, vp_stage, model)


def end_chunk(config: Any, hidden_states: Any) -> None:
    """Called by ``GPTModel.forward`` on the decoder's output: the chunk's backward starts where its gradient
    arrives (a hook on it, no autograd node: the output stays the very tensor the schedule may deallocate)."""
    if getattr(config, "fine_grained_activation_offloading", False):
        get_manager().end_chunk(hidden_states)


def layer_boundary(config: Any) -> None:
    """Called at the top of ``TransformerLayer.forward``."""
    manager = _manager_module._MANAGER
    # no forward handler: not a training forward, or offloading is off (the manager's method would do nothing)
    if manager is None or manager.forward_handler is None:
        return
    if getattr(config, "fine_grained_activation_offloading", False):
        native = manager.native_points
        if native is not None:  # the same in C++ (runtime/native/layer_boundary.cpp), auto's steps left to Python
            native.layer_boundary(manager, ROUTED_POINTS, MIN_STORAGE_COVERAGE)
        else:
            manager.layer_boundary()


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
