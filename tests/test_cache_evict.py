"""benchmarks/cache_evict.py's premise: its backward evictions run after the offload points' own pre-hooks on the
same autograd node. PyTorch runs a node's C++ pre-hooks in the order they were added and its Python pre-hooks
together, at the place of the first Python one: the eviction (a Python pre-hook added after ours) runs after our
C++ hook unless a Python pre-hook sat on that node before ours. Also the probe's two kinds and its bad input."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mcore_offload.runtime import native as native_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from cache_evict import CoreAttnEvict  # noqa: E402


def _order(python_first: bool) -> list[str]:
    native = native_module.load_native()
    order: list[str] = []
    y = torch.ones(3, requires_grad=True) * 2
    if python_first:
        y.grad_fn.register_prehook(lambda grads: order.append("python before ours"))
    assert native.add_prehook(y, lambda _: order.append("ours"))
    y.grad_fn.register_prehook(lambda grads: order.append("eviction"))
    y.sum().backward()
    return order


def test_the_eviction_prehook_runs_after_our_cpp_prehook():
    assert _order(python_first=False) == ["ours", "eviction"]
    # the case the probe's docstring names: a Python pre-hook registered before ours pulls the eviction before it
    assert _order(python_first=True) == ["python before ours", "eviction", "ours"]


def test_eviction_kinds_count_and_refuse_both_or_neither():
    ev = CoreAttnEvict(mib=0.25)
    ev.evict()
    ev.evict()
    assert ev.as_dict(1)["mib"] == 0.25 and ev.as_dict(1)["spin_us"] == 0 and ev.buffer[0].item() == 2
    spin = CoreAttnEvict(spin_us=20)
    spin.evict()
    assert spin.as_dict(1)["evict_us_mean"] >= 20
    for bad in ({}, {"mib": 1, "spin_us": 5}):
        with pytest.raises(ValueError, match="either mib or spin_us"):
            CoreAttnEvict(**bad)
