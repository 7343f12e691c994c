"""The MoE dispatcher's token counts: which function the patched dispatcher gets, and the fallbacks of the kernel read
(mcore_offload/runtime/host_counts.py). The kernel path itself needs CUDA: tests/test_gpu.py."""

from __future__ import annotations

import types

import pytest
import torch
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu

from mcore_offload.runtime import host_counts, points


def _config(on: bool) -> types.SimpleNamespace:
    return types.SimpleNamespace(fine_grained_activation_offloading=on, offload_modules=["expert_fc1"] if on else [])


def test_offloading_configs_get_the_kernel_read_and_others_megatrons_copy(monkeypatch):
    monkeypatch.delenv("MCORE_OFFLOAD_KERNEL_COUNTS", raising=False)
    assert points.counts_reader(_config(True)) is host_counts.counts_to_host
    assert points.counts_reader(_config(False)) is maybe_move_tensor_to_cpu
    assert points.counts_reader(types.SimpleNamespace()) is maybe_move_tensor_to_cpu  # an unpatched config


def test_the_switch_keeps_megatrons_copy_and_refuses_other_values(monkeypatch):
    monkeypatch.setenv("MCORE_OFFLOAD_KERNEL_COUNTS", "0")
    assert points.counts_reader(_config(True)) is maybe_move_tensor_to_cpu
    monkeypatch.setenv("MCORE_OFFLOAD_KERNEL_COUNTS", "yes")
    with pytest.raises(ValueError, match=r"^MCORE_OFFLOAD_KERNEL_COUNTS='yes' is not 0 or 1: .*unset it$"):
        points.counts_reader(_config(True))


def test_the_patched_dispatcher_takes_its_copy_function_from_the_reader():
    # patch 07: the marker, and the one call site reading the function per dtoh point
    assert hasattr(token_dispatcher, "_mcore_offload_points")
    import inspect

    source = inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize)
    assert "maybe_move_tensor_to_cpu = _mcore_offload_points.counts_reader(self.config)" in source
    assert source.index("counts_reader") < source.index("maybe_move_tensor_to_cpu(")


@pytest.mark.parametrize("value", [torch.arange(4), None, 3, torch.zeros(2, dtype=torch.float32)])
def test_what_is_not_a_cuda_integer_tensor_goes_through_megatrons_function(value, monkeypatch):
    seen = []

    def megatron_copy(tensor, as_numpy=False, record_stream=False):
        seen.append((tensor, as_numpy, record_stream))
        return "megatron"

    monkeypatch.setattr(host_counts, "_megatron_copy", lambda: megatron_copy)
    assert host_counts.counts_to_host(value, as_numpy=True, record_stream=True) == "megatron"
    assert seen == [(value, True, True)]


def test_a_buffer_the_device_does_not_map_gives_no_alias(monkeypatch):
    host = torch.arange(4, dtype=torch.int64)

    def refuse(obj, device=None):
        raise RuntimeError("The specified pointer resides on host memory and is not registered with any CUDA device.")

    monkeypatch.setattr(host_counts.torch, "as_tensor", refuse)
    assert host_counts.device_alias(host, torch.device("cuda", 0)) is None
    # an empty buffer is never aliased (no address to map)
    assert host_counts.device_alias(torch.empty(0, dtype=torch.int64), torch.device("cuda", 0)) is None


def test_a_copy_instead_of_an_alias_is_refused(monkeypatch):
    host = torch.arange(4, dtype=torch.int64)
    monkeypatch.setattr(host_counts.torch, "as_tensor", lambda obj, device=None: host.clone())
    assert host_counts.device_alias(host, torch.device("cpu")) is None


def test_the_interface_describes_the_host_buffer_itself():
    host = torch.arange(6, dtype=torch.int32).view(2, 3)
    face = host_counts._MappedView(host).__cuda_array_interface__
    assert face["data"] == (host.data_ptr(), False) and face["shape"] == (2, 3) and face["typestr"] == "<i4"
    assert face["stream"] is None  # no synchronisation: the kernel is ordered by the dispatcher's own stream
