"""GPU-only: the two prefetch cases sessions 69-70 fixed on the CPU, on CUDA streams and events. Skipped without CUDA;
on the GPU host (as tests/test_gpu.py):

    MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 python3 -m pytest -q -m gpu tests/test_gpu_prefetch.py

- a plan that leaves a layer out (83b14db): the layer above the gap must prefetch the one below it;
- a point committed at the layer's output (``mlp_norm``), whose commit hook shares a node with the next layer's start
  hook (c37a91f): under the late prefetch the layer above must start its burst before that commit reloads on demand.

A reload on demand costs time, never correctness, so each test checks both: bitwise equality with no offloading, and
no byte reloaded on demand.
"""

from __future__ import annotations

import pytest
import torch

from mcore_offload.runtime import manager as manager_module
from mcore_offload.runtime.auto_choice import Plan
from mcore_offload.runtime.manager import get_manager
from mcore_offload.summary import get_summary
from tests.test_prefetch_gaps import POINTS, NormToy, assert_bitwise_equal
from tests.test_runtime_unit import Toy, cfg, toy_steps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU host)")]
HIDDEN = 512


def cuda_steps(model: torch.nn.Module, steps: int) -> list:
    """:func:`toy_steps` on CUDA, with inputs as wide as the model."""
    return toy_steps(model, steps, shape=(256, HIDDEN), device="cuda")


@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp", "python"])
@pytest.mark.parametrize("prefetch", ["layer", "tail"])
def test_cuda_prefetch_crosses_a_layer_left_out_of_the_plan(monkeypatch, native, prefetch):
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", native)
    monkeypatch.setenv("MCORE_OFFLOAD_PREFETCH", prefetch)
    manager_module.reset()
    base = cuda_steps(Toy(cfg(), layers=6, hidden=HIDDEN).cuda(), steps=3)
    manager_module.reset()
    model = Toy(cfg("auto"), layers=6, hidden=HIDDEN).cuda()
    cuda_steps(model, steps=1)  # the manager and its planner exist once a chunk began
    assert (get_manager().native is not None) == (native == "1")
    get_manager().auto.plan = Plan({(None, layer): POINTS for layer in (2, 3, 5, 6)}, 0, True, 1000.0)
    get_summary().steps.clear()
    assert_bitwise_equal(base, cuda_steps(model, steps=3))
    for step in get_summary().steps:
        assert step.total("reloaded") == step.total("offloaded") > 0
        assert step.total("reloaded_on_demand") == 0  # layer 5's backward brought layer 3 back, across layer 4
    manager_module.reset()


@pytest.mark.parametrize("native", ["1", "0"], ids=["cpp", "python"])
def test_cuda_late_prefetch_reaches_the_layer_output_point_below(monkeypatch, native):
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", native)
    monkeypatch.setenv("MCORE_OFFLOAD_PREFETCH", "late")
    manager_module.reset()
    base = cuda_steps(NormToy(cfg(), layers=4, hidden=HIDDEN).cuda(), steps=3)
    manager_module.reset()
    got = cuda_steps(NormToy(cfg("qkv_linear", "mlp_norm"), layers=4, hidden=HIDDEN).cuda(), steps=3)
    assert (get_manager().native is not None) == (native == "1")
    assert_bitwise_equal(base, got)
    last = get_summary().last_step
    assert last.points["mlp_norm"]["reloaded"] == last.points["mlp_norm"]["offloaded"] > 0
    assert get_summary().as_dict()["reloaded_on_demand_per_step"] == [0, 0, 0]
    manager_module.reset()
