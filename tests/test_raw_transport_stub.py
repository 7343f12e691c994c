"""The raw CUDA transport (``RawCudaTransport``: fences, waits, copy loops, done events, telemetry marks), run end to
end on the CPU: a stub CUDA runtime whose cudaMemcpyAsync copies synchronously and whose events are complete when
queried (``benchmarks/cpu_transport_glue.py``) stands for the GPU. Values and counters must be those of the CPU
transport, under the C++ and the Python runtime; the GPU tests check the same on the real runtime."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_runtime_unit import Toy, cfg, toy_steps

from mcore_offload.runtime import manager as manager_module
from mcore_offload.runtime import raw_transport as raw_transport_module
from mcore_offload.runtime import transport as transport_module
from mcore_offload.runtime.coalesce import coalesce_reloads
from mcore_offload.summary import get_summary

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cpu_transport_glue  # noqa: E402

pytestmark = pytest.mark.usefixtures("hook_impl")


@pytest.fixture(scope="module")
def copying_runtime(tmp_path_factory):
    if cpu_transport_glue.compiler() is None:
        pytest.skip("no C compiler for the stub CUDA runtime")
    return cpu_transport_glue.stub_runtime(tmp_path_factory.mktemp("stub"), real_copies=True, log=True)


def _train(names, steps=3, microbatches=2, layers=4, transport=None):
    """Losses and gradients per step; with ``transport``, it serves the CPU device instead of the CPU transport."""
    manager_module.reset()
    if transport is not None:
        transport_module._TRANSPORTS[torch.device("cpu")] = transport
    return toy_steps(Toy(cfg(*names), layers=layers), steps, microbatches)


def _counters():
    return [{k: s.total(k) for k in ("offloaded", "reloaded", "released_in_forward", "kept_on_device")}
            for s in get_summary().steps]


@pytest.mark.parametrize("coalesce", ["0", "1"])
@pytest.mark.parametrize("prefetch", ["layer", "late"])
@pytest.mark.parametrize("names", [["core_attn"], ["qkv_linear", "attn_proj"],
                                   ["qkv_linear", "core_attn", "attn_proj"]])
def test_the_raw_transport_on_the_stub_runtime_moves_the_same_bytes_with_equal_values(
        monkeypatch, copying_runtime, names, prefetch, coalesce):
    """``coalesce`` (MCORE_OFFLOAD_COALESCE_RELOADS, C++ runtime only): one host buffer per copy-out burst, one reload
    copy per group into one device block; the same values, counters and buffers, with fewer reload copies."""
    monkeypatch.setenv("MCORE_OFFLOAD_PREFETCH", prefetch)
    monkeypatch.setenv("MCORE_OFFLOAD_COALESCE_RELOADS", coalesce)
    base = _train([])
    plain = _train(names)
    plain_counters = _counters()
    # the C++ copy loop and reload allocations where the hook_impl fixture builds them; steps 0-3 timed, as on the GPU
    raw = cpu_transport_glue.stub_transport(copying_runtime, device_index=-1, native=True, timed_from_start=True)
    bursts = {"to_host": 0, "to_device": 0, "reloaded_storages": 0}
    real_to_host = raw_transport_module.RawCudaTransport.to_host
    real_to_device = raw_transport_module.RawCudaTransport.to_device

    def offloads(self, storages, keep_alive, routed):
        bursts["to_host"] += 1
        return real_to_host(self, storages, keep_alive, routed)

    def reloads(self, hosts, sizes, after, device, parts=None):
        bursts["to_device"] += 1
        bursts["reloaded_storages"] += len(hosts)
        return real_to_device(self, hosts, sizes, after, device, parts)

    monkeypatch.setattr(raw_transport_module.RawCudaTransport, "to_host", offloads)
    monkeypatch.setattr(raw_transport_module.RawCudaTransport, "to_device", reloads)
    cpu_transport_glue.stub_calls(copying_runtime)  # clears the stub's call log
    # the C++ copy-out and reload call the C++ bursts without the methods above: their phase clock counts those
    clock = raw.native is not None and hasattr(raw.native, "burst_timing")
    if clock:
        raw.native.burst_timing(True)
    try:
        got = _train(names, transport=raw)
    finally:
        if clock:
            counted = raw.native.burst_timing(False)
            bursts["to_host"] += counted["to_host"]["bursts"]
            bursts["to_device"] += counted["to_device"]["bursts"]
            bursts["reloaded_storages"] += counted["to_device"]["copies"]  # one copy per storage in a C++ burst
    # the copies the stub runtime received (from the C++ bursts or the Python ones), by stream
    h2d_copies = sum(1 for c in cpu_transport_glue.stub_calls(copying_runtime)
                     if c[0] == "copy" and c[5] == raw._h2d_handle)
    assert transport_module._TRANSPORTS[torch.device("cpu")] is raw
    for (l0, g0), (l1, g1), (l2, g2) in zip(base, plain, got):
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(l0, l1, l2))
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(g0, g1, g2))
    assert _counters() == plain_counters and plain_counters[-1]["reloaded"] > 0
    assert bursts["to_host"] > 0 and bursts["to_device"] > 0
    summary = get_summary()
    summary.resolve_link(wait=True)
    # every step was timed here (the stub's clock says 0.1 ms a span): the marks and done events paired up
    for s in summary.steps:
        assert s.link is not None and s.link.d2h_bytes > 0 and s.link.h2d_bytes == s.link.d2h_bytes
        assert s.link.d2h_GBps is not None and s.link.h2d_GBps is not None and s.link.stall_ms is not None
    assert summary.host_resident_bytes == 0 and not raw._held and not raw._slices_left
    coalesced = coalesce == "1" and raw.native is not None
    # buffers reused, none left out of the pool; coalesced, a burst's buffer follows the flush bursts, which take
    # one layer each in a chunk's first forward and two from its second (MCORE_OFFLOAD_FLUSH_LAYERS): step 1 may
    # allocate the larger ones
    allocations = [s.host_buffer_allocations for s in summary.steps]
    free = [b.data_ptr() for bufs in raw.pool._free.values() for b, _ in bufs]
    assert len(free) == len(set(free)) == allocations[0] + allocations[1]  # each buffer back once, all of them
    assert allocations[2:] == [0] and (coalesced or allocations[1] == 0)
    # a group that saves several storages comes back in one copy; qkv_linear's and attn_proj's groups save one each
    several = names != ["qkv_linear", "attn_proj"]
    assert (h2d_copies < bursts["reloaded_storages"]) == (coalesced and several)
    assert h2d_copies <= bursts["reloaded_storages"] and h2d_copies > 0


def test_a_bad_coalesce_value_is_one_clear_sentence(monkeypatch):
    monkeypatch.setenv("MCORE_OFFLOAD_COALESCE_RELOADS", "yes")
    with pytest.raises(ValueError, match=r"MCORE_OFFLOAD_COALESCE_RELOADS='yes' is not 0 or 1: set it to 1 for one "
                                         r"reload copy per group, or unset it"):
        coalesce_reloads()
