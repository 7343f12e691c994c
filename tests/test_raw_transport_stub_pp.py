"""The raw CUDA transport on the stub CUDA runtime (see tests/test_raw_transport_stub.py) under megatron-core's
interleaved pipeline schedule: PP=2 x VPP=2, two gloo processes on CPU, dense and MoE points, with and without
coalesced reloads (MCORE_OFFLOAD_COALESCE_RELOADS). The late reloads (``tail``), end_chunk's reloads and the
turned-around chunks run here as in configuration D; each rank must match its run without offloading bit for bit,
and every hand-off between streams in its logged CUDA calls must be ordered by events (tests/test_stream_order.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.harness.gpt import build_dense_gpt, build_moe_gpt, init_parallel, run_steps
from tests.harness.multiproc import run_multiprocess
from tests.test_offload_megatron import DENSE_POINTS, MOE_POINTS, STEPS, assert_bitwise, offload

BENCHMARKS = str(Path(__file__).resolve().parent.parent / "benchmarks")

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def stub_pp_job(rank: int, world_size: int, lib: str, coalesce: str, moe: bool) -> dict[str, Any]:
    """Worker: the same PP=2 x VPP=2 model without offloading, then with it over the stub runtime's raw transport."""
    import ctypes
    import os

    sys.path.insert(0, BENCHMARKS)
    import cpu_transport_glue

    from mcore_offload.runtime import cudart
    from mcore_offload.runtime import transport as transport_module
    from mcore_offload.runtime.manager import get_manager, reset
    from mcore_offload.summary import get_summary
    from tests.harness.stream_order import hazards, host_ranges, reuse_waits

    os.environ["MCORE_OFFLOAD_COALESCE_RELOADS"] = coalesce
    init_parallel(world_size, rank, pp=2, vpp=2)
    build = build_moe_gpt if moe else build_dense_gpt
    out: dict[str, Any] = {}
    rt = cudart.CudaRuntime(ctypes.CDLL(lib))
    for key, overrides in (("base", None), ("offload", offload(*(MOE_POINTS if moe else DENSE_POINTS)))):
        reset()
        raw = cpu_transport_glue.stub_transport(rt, -1, native=True, timed_from_start=True)
        transport_module._TRANSPORTS[torch.device("cpu")] = raw
        cpu_transport_glue.stub_calls(rt)  # this run's calls only
        chunks = build(num_layers=8, config_overrides=overrides)
        out[key] = run_steps(chunks, n_steps=STEPS, num_microbatches=4, seq_len=16, micro_batch_size=2, lr=0.1)
    calls = cpu_transport_glue.stub_calls(rt)
    out["hazards"] = hazards(calls, host_ranges(raw))[:5]
    # each reused buffer's last reload was already waited for by the compute stream, so no reuse wait is needed
    out["reuse_waits"] = reuse_waits(calls, raw)
    last = get_summary().last_step
    out["bytes"] = {c: last.total(c) for c in ("offloaded", "released_in_forward", "reloaded", "reloaded_on_demand")}
    out["raw_ran"] = raw.pool.allocations > 0 and transport_module._TRANSPORTS.get(torch.device("cpu")) is raw
    out["coalesced"] = raw.coalesce and raw.native is not None
    out["slices_left"] = len(raw._slices_left)
    out["allocations"] = [s.host_buffer_allocations for s in get_summary().steps[-STEPS:]]
    out["second_look"] = get_manager().second_look_bytes  # the first stage's embedding outputs (second_look.py)
    return out


@pytest.mark.parametrize("coalesce", ["0", "1"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_interleaved_pp2_vpp2_over_the_raw_transport_bitwise_equal(tmp_path, coalesce, moe):
    sys.path.insert(0, BENCHMARKS)
    import cpu_transport_glue

    if cpu_transport_glue.compiler() is None:
        pytest.skip("no C compiler for the stub CUDA runtime")
    cpu_transport_glue.stub_runtime(tmp_path, real_copies=True, log=True)
    lib = str(tmp_path / "libstubcudart_copy_log.so")
    results = run_multiprocess(stub_pp_job, 2, args=(lib, coalesce, moe), timeout_s=240)
    for r in results:
        assert r["raw_ran"] and r["coalesced"] == (coalesce == "1") and r["slices_left"] == 0
        assert_bitwise(r["base"], r["offload"])
        assert r["hazards"] == [] and r["reuse_waits"] == 0
        b = r["bytes"]
        assert b["offloaded"] > 0 and b["released_in_forward"] == b["offloaded"] == b["reloaded"]
        assert b["reloaded_on_demand"] == 0
        if not moe:  # no pinned allocation after the first step, second look included (the tiny MoE's routed
            # sizes change between steps here)
            assert r["allocations"][1:] == [0] * (STEPS - 1), r["allocations"]
    # the second look's copies went through the same hand-offs (hazards above) on the first stage only
    assert results[0]["second_look"] > 0 and results[1]["second_look"] == 0
