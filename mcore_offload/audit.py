"""Offload audit: prove, in bytes, that nothing that must stay on the device was offloaded.

What must stay: parameters, their ``main_grad`` buffers, and TransformerEngine's cached FP8 weight
workspaces (``module._fp8_workspaces``: quantized copies of the weights, reused across microbatches). Copying
any of them would cost link time and free nothing, and reloading a stale copy over a workspace would be wrong.

Usage (what ``benchmarks/pretrain_gpt.py --audit-offloaded`` does)::

    audit = OffloadAudit()          # starts recording every offloaded storage
    for step ...:
        train_step()
        audit.check(model_chunks)   # after each step: compare with what is alive now
    audit.as_dict()                 # {"offloaded_bytes", "protected_bytes", "overlap_bytes"}

Check after every step, not once at the end: an offloaded activation's address is only meaningful while the
protected tensors that were alive during the step are still where they were (they are: parameters and
cached workspaces persist). The first step is recorded but not judged, because workspaces are created during
it and may reuse the address of an activation offloaded and freed earlier in the same forward.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import torch

from mcore_offload.runtime.manager import get_manager

KINDS = ("parameter", "main_grad", "te_workspace")


def _storage_range(t: object) -> tuple[int, int] | None:
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses own no storage
        return None
    start, n = st.data_ptr(), st.nbytes()
    return (start, start + n) if start and n else None


def _workspace_tensors(workspace: object) -> list[object]:
    """The plain tensors holding a TE workspace's bytes (data, transpose, scales), whatever its class."""
    if type(workspace) is torch.Tensor:
        return [workspace]
    return [v for v in getattr(workspace, "__dict__", {}).values() if isinstance(v, torch.Tensor)]


def protected_ranges(models: Iterable[torch.nn.Module]) -> dict[str, list[tuple[int, int]]]:
    """Address ranges ``[start, end)`` of every storage that must stay on the device, by kind.

    Walks the model itself rather than reusing the manager's ``_parameter_storages``: an audit that shared
    the mechanism it checks would agree with any bug in it.
    """
    found: dict[str, set[tuple[int, int]]] = {k: set() for k in KINDS}
    for model in models:
        for p in model.parameters():
            for kind, t in (("parameter", p), ("main_grad", getattr(p, "main_grad", None))):
                r = _storage_range(t)
                if r is not None:
                    found[kind].add(r)
        for module in model.modules():
            for ws in (getattr(module, "_fp8_workspaces", None) or {}).values():
                for t in _workspace_tensors(ws):
                    r = _storage_range(t)
                    if r is not None:
                        found["te_workspace"].add(r)
    return {k: sorted(v) for k, v in found.items()}


def overlap_bytes(offloaded: Iterable[tuple[int, int]], ranges: list[tuple[int, int]]) -> int:
    """Bytes of the offloaded storages ``(address, nbytes)`` that overlap any of ``ranges``."""
    merged: list[list[int]] = []
    for s, e in sorted(ranges):  # disjoint union, so the nearest range below an end decides
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    starts = [s for s, _ in merged]
    total = 0
    for ptr, n in offloaded:
        i = bisect.bisect_left(starts, ptr + n)  # ranges starting before our end
        if i > 0 and merged[i - 1][1] > ptr:
            total += n
    return total


class OffloadAudit:
    """Records every offloaded storage (via the manager's ``offload_log``) and judges it after each step."""

    def __init__(self) -> None:
        self.steps = 0
        self.offloaded_bytes = 0
        self.protected_bytes: dict[str, int] = dict.fromkeys(KINDS, 0)  # largest total seen, by kind
        self.overlap: dict[str, int] = dict.fromkeys(KINDS, 0)
        get_manager().offload_log = []

    def check(self, models: Iterable[torch.nn.Module]) -> dict[str, int]:
        """Judge the storages offloaded since the last check; return this step's overlap by kind."""
        manager = get_manager()
        log, manager.offload_log = manager.offload_log or [], []
        self.steps += 1
        found = dict.fromkeys(KINDS, 0)
        if self.steps == 1:
            return found
        ranges = protected_ranges(models)
        self.offloaded_bytes += sum(n for _, n in log)
        for kind in KINDS:
            self.protected_bytes[kind] = max(self.protected_bytes[kind], sum(e - s for s, e in ranges[kind]))
            found[kind] = overlap_bytes(log, ranges[kind])
            self.overlap[kind] += found[kind]
        return found

    def as_dict(self) -> dict:
        return {"judged_steps": max(self.steps - 1, 0), "offloaded_bytes": self.offloaded_bytes,
                "protected_bytes": dict(self.protected_bytes), "overlap_bytes": dict(self.overlap)}

    def close(self) -> None:
        get_manager().offload_log = None
