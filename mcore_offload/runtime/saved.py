"""What the handler keeps per saved tensor and per offloaded storage, and the checks that decide whether a storage
may leave the device.

- :class:`SavedRef`: what the pack hook returns for an eligible tensor (the tensor, later its view of an entry);
- :class:`Entry`: one offloaded storage (host buffer, events, reloaded copy);
- :class:`Group`: the saved tensors of one offload point (or chain of points) in one layer;
- :func:`covers` and :func:`held_elsewhere`: a storage moves only if its saved views cover at least half of it and no
  tensor other than ours holds it (``runtime/native/copy_path.cpp`` does the same for the one-view case).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

# A storage is offloaded only if the views saved from it cover at least half of it: copying a whole
# large buffer for a small slice (persistent buffers, KV caches) would cost link time and free nothing.
MIN_STORAGE_COVERAGE = 0.5
# Points whose saved storages are sized by the MoE routing (tokens per local expert): their host buffers get
# spare room (transport.HostBufferPool.ROUTED_HEADROOM)
ROUTED_POINTS = frozenset({"expert_fc1", "moe_act"})
# Chains: a point and the point that always comes next in the same layer and consumes its output (so that the
# next point's backward runs before the first one's, and the shared group is done when the first one's start
# node runs). With both on, they form one group. Attention's three points run inside SelfAttention.forward;
# expert_fc1 and moe_act inside one expert MLP forward. Chains never cross from attention to the MLP: a layer
# of a MoE model with moe_layer_freq may have no experts.
CHAIN_NEXT: dict[str, str] = {"qkv_linear": "core_attn", "core_attn": "attn_proj", "expert_fc1": "moe_act"}


def routed_key(point: str) -> str | None:
    return point if point in ROUTED_POINTS else None


class Entry:
    """One offloaded storage (slots: one is made per storage and flush, on the hot path)."""

    __slots__ = ("point", "nbytes", "host", "d2h_event", "device_storage", "h2d_event", "h2d_seq", "compute_waited",
                 "users", "storage_ref", "off_device", "device_ptr", "peak_key", "awaiting", "reloaded_ref")

    def __init__(self, point: str, nbytes: int, host: torch.Tensor | None, d2h_event: Any, device_ptr: int = 0) -> None:
        self.point = point
        self.nbytes = nbytes
        self.host = host
        self.d2h_event = d2h_event
        self.device_storage: torch.UntypedStorage | None = None
        self.h2d_event: Any = None
        self.h2d_seq = 0  # the number of the reload burst that brought it back (Transport.wait_reload)
        self.compute_waited = False
        self.users = 0  # groups whose backward has not finished yet
        self.storage_ref: Any = None  # weakref to the original device storage
        self.off_device = False  # the original storage is freed and no reloaded copy exists yet
        self.device_ptr = device_ptr  # the original storage's address (audits: never a parameter's or a workspace's)
        self.peak_key: Any = None  # auto's peak step: (vp_stage, layer, point), for what is off at the peak
        self.awaiting = 0  # saved views of this storage not yet read by backward (handler._first_read)
        self.reloaded_ref: Any = None  # weak reference to the reloaded storage once every view was read


class SavedRef:
    """What the pack hook returns for an eligible tensor: the tensor, then (once offloaded) its view."""

    __slots__ = ("tensor", "group", "point", "entry", "dtype", "offset", "size", "stride", "unpacked", "__weakref__")

    def __init__(self, tensor: torch.Tensor, group: Group, point: str) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.group = group
        self.point = point  # the offload point that saved it (a group may span consecutive points)
        self.entry: Entry | None = None
        self.unpacked = False  # read by backward since it was offloaded (handler._first_read)


@dataclass(eq=False, slots=True)
class Group:
    name: str  # the first point of the group
    points: list[str] = field(default_factory=list)  # every point it spans (see runtime/points.py: chains)
    refs: list[SavedRef] = field(default_factory=list)
    # weak references to the refs that still held their tensor when backward reached the group (an abort cuts them)
    let_go: list = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)  # why saved tensors stayed, for the log
    parameters: int = 0  # saved parameters (rejected by the pack hook's fast path, not in ``rejected``)
    entries: list[Entry] = field(default_factory=list)
    layer: int = 0  # the handler's layer count when the group opened
    index: int = -1  # position among the handler's committed groups
    committed: bool = False
    kept_on_device: bool = False
    done: bool = False


def covers(refs: list[SavedRef], need: float) -> bool:
    """Whether the distinct byte ranges the saved views start at cover ``need`` bytes (a view saved twice counts
    once). Stops as soon as they do: a grouped GEMM saves one view per expert, and half of them suffice."""
    covered, seen = 0, set()
    for r in refs:
        t = r.tensor
        size = t.element_size()
        key = (t.storage_offset() * size, t.numel() * size)
        if key not in seen:
            seen.add(key)
            covered += key[1]
            if covered >= need:
                return True
    return False


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def held_elsewhere(storage: torch.UntypedStorage, refs: list[SavedRef]) -> bool:
    """Whether a tensor other than the ones we hold references ``storage``."""
    if _storage_use_count is None:  # private API gone: assume sole ownership, as TE does
        return False
    return held_by_other_than_one(storage, refs[0]) if len(refs) == 1 else held_by_other_than_many(storage, refs)


def held_by_other_than_one(storage: torch.UntypedStorage, ref: SavedRef) -> bool:
    """:func:`held_elsewhere` for one saved reference, the common case: the same counts without the dicts
    (a third of the host time in a real step; tests check both answers agree)."""
    t = ref.tensor
    base = t._base
    # storage users: the saved tensor, its base if it is a view, and the storage object we hold
    if _storage_use_count(storage._cdata) > (2 if base is None else 3):
        return True
    # Python references to the tensor: the SavedRef, ``t`` and getrefcount's argument
    if sys.getrefcount(t) > 3:
        return True
    # to the base: ``base``, the argument and the view's C++ side
    return base is not None and sys.getrefcount(base) > 3


def held_by_other_than_many(storage: torch.UntypedStorage, refs: list[SavedRef]) -> bool:
    tensors = {id(r.tensor): r.tensor for r in refs}
    # A view keeps its base alive, so the base counts as ours too (``_base`` is always the root).
    bases = {id(t._base): t._base for t in tensors.values() if t._base is not None}
    for k in tensors:
        bases.pop(k, None)
    ours = len(tensors) + len(bases) + 1  # + the storage object we hold
    if _storage_use_count(storage._cdata) > ours:
        return True
    # The very tensor object we saved may be held elsewhere too (a cached attention mask saved by
    # every layer): Python references beyond our SavedRefs, the dict above and the loop variable.
    uses = {k: 0 for k in tensors}
    for r in refs:
        uses[id(r.tensor)] += 1
    # A saved tensor that is the base of another saved view (attention's output saved by core_attn, its
    # reshape saved by attn_proj) has one more: the Python object the view's C++ side keeps alive.
    for k in {id(t._base) for t in tensors.values() if t._base is not None} & uses.keys():
        uses[k] += 1
    for k in tensors:
        t = tensors[k]
        if sys.getrefcount(t) - 3 > uses[k]:  # 3 = the dict value, ``t`` and getrefcount's argument
            return True
    for k in bases:
        b = bases[k]
        # 4 = the dict value, ``b``, the argument, and the reference the views' C++ side keeps; more means
        # Python code still holds the base (a received pipeline activation in the schedule's list).
        if sys.getrefcount(b) > 4:
            return True
    return False


def saved_nothing_line(name: str, rejected: dict[str, int]) -> str:
    """The log line for a point whose block saved nothing to offload (``rejected``: how many saved tensors stayed,
    by reason), with the usual cause where one applies."""
    why = ", ".join(f"{n} {r}" for r, n in sorted(rejected.items())) or "none saved"
    line = f"offload point {name} saved no tensor that can be offloaded here ({why})"
    if name in ("attn_norm", "mlp_norm"):
        line += "; with the TransformerEngine spec a norm fused into the next linear saves nothing of its own"
    if rejected.get("under min_offloaded_tensor_size"):
        # a SequentialMLP's experts each save their own fc1 output, which fine-grained experts keep small
        line += "; lower min_offloaded_tensor_size to offload the small ones"
    return line
