"""The offload audit: what must stay on the device (parameters, main_grad, TE workspaces) is found, and any
offloaded storage overlapping it is counted in bytes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mcore_offload.audit import OffloadAudit, overlap_bytes, protected_ranges
from mcore_offload.runtime.manager import get_manager
from tests.test_runtime_unit import Toy, cfg, train_step


def test_overlap_counts_every_offloaded_storage_touching_a_range():
    ranges = [(100, 200), (150, 160), (300, 400)]  # a nested range must not hide its container
    assert overlap_bytes([(0, 100), (200, 100), (400, 8)], ranges) == 0  # adjacent is not overlapping
    assert overlap_bytes([(190, 20)], ranges) == 20
    assert overlap_bytes([(170, 5), (50, 300), (399, 1)], ranges) == 5 + 300 + 1
    assert overlap_bytes([(10, 5)], []) == 0


class _Float8Like:
    """What TE caches in ``_fp8_workspaces``: an object whose plain tensors hold the bytes."""

    def __init__(self, n: int) -> None:
        self._data = torch.empty(n, dtype=torch.uint8)
        self._transpose = torch.empty(n, dtype=torch.uint8)
        self._scale_inv = torch.ones(1)
        self._quantizer = SimpleNamespace(dtype="e4m3")


def test_protected_ranges_find_parameters_main_grads_and_workspaces():
    model = torch.nn.Linear(32, 32)
    model.weight.main_grad = torch.zeros(32, 32)
    model._fp8_workspaces = {"weight": _Float8Like(1024)}
    found = protected_ranges([model])
    assert sum(e - s for s, e in found["parameter"]) == (32 * 32 + 32) * 4
    assert sum(e - s for s, e in found["main_grad"]) == 32 * 32 * 4
    assert sum(e - s for s, e in found["te_workspace"]) == 2 * 1024 + 4
    ws = model._fp8_workspaces["weight"]._data
    assert overlap_bytes([(ws.data_ptr(), 1024)], found["te_workspace"]) == 1024


def test_audit_of_a_real_offloaded_run_is_zero_and_a_planted_parameter_is_caught():
    model = Toy(cfg("qkv_linear", "core_attn", "attn_proj"))
    model._fp8_workspaces = {"weight": _Float8Like(4096)}
    audit = OffloadAudit()
    for step in range(3):
        model.zero_grad()
        train_step(model, [torch.randn(8, 16, generator=torch.Generator().manual_seed(step))])
        assert audit.check([model]) == {"parameter": 0, "main_grad": 0, "te_workspace": 0}
    got = audit.as_dict()
    assert got["judged_steps"] == 2 and got["offloaded_bytes"] > 0
    assert got["protected_bytes"]["parameter"] > 0 and got["protected_bytes"]["te_workspace"] > 0
    # the audit can fail: a parameter's and a workspace's storage "offloaded" are counted in full
    w = model.qkv[0].weight
    get_manager().offload_log += [(w.data_ptr(), w.numel() * 4),
                                  (model._fp8_workspaces["weight"]._transpose.data_ptr(), 4096)]
    assert audit.check([model]) == {"parameter": w.numel() * 4, "main_grad": 0, "te_workspace": 4096}
    audit.close()
    assert get_manager().offload_log is None
