"""GPU-only: the MoE dispatcher's token counts written into pinned memory by a kernel (runtime/host_counts.py), as the
patched all-to-all dispatcher reads them while offloading. Skipped without CUDA; on the GPU host:

    MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 python3 -m pytest -q -m gpu tests/test_gpu_host_counts.py

Correctness only (values, memory kind, stream order, fallbacks). How long a read waits behind an offload burst is a
benchmark: ``benchmarks/gpu/d2h_contention.py`` (its ``d2h_1_kernel_read`` case).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcore_offload.runtime import host_counts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU host)")]


def _read_on_side_stream(counts: torch.Tensor) -> torch.Tensor:
    """As the dispatcher reads: its side stream waits for the compute stream, reads, records an event; the host
    waits for that event."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host = host_counts.counts_to_host(counts, record_stream=True)
        done = side.record_event()
    done.synchronize()
    return host


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_counts_land_in_pinned_memory_equal_to_a_copy(dtype):
    counts = torch.randint(0, 1 << 20, (4, 16), device="cuda", dtype=dtype)
    view = counts[:, ::2]  # the dispatcher passes views too
    host = _read_on_side_stream(view)
    assert host.device.type == "cpu" and host.is_pinned() and host.dtype == dtype
    assert torch.equal(host, view.cpu())
    # the memory the kernel wrote is the host tensor's own, not a copy made by as_tensor
    alias = host_counts.device_alias(host, counts.device)
    assert alias is not None and alias.data_ptr() == host.data_ptr()


def test_numpy_scalars_and_the_float_fallback():
    total = torch.tensor(12345, device="cuda", dtype=torch.int64)  # num_out_tokens is a 0-d tensor
    splits = torch.tensor([3, 1, 4], device="cuda", dtype=torch.int64)
    out_total = host_counts.counts_to_host(total)
    out_splits = host_counts.counts_to_host(splits, as_numpy=True)
    probs = host_counts.counts_to_host(torch.tensor([0.5, -0.0], device="cuda"))  # not integers: megatron's copy
    torch.cuda.synchronize()
    assert out_total.shape == () and int(out_total) == 12345
    assert isinstance(out_splits, np.ndarray) and out_splits.tolist() == [3, 1, 4]
    assert probs.device.type == "cpu" and torch.equal(probs, torch.tensor([0.5, -0.0]))
    assert torch.signbit(probs[1])  # bit for bit: a kernel adding 0 would have turned -0.0 into +0.0


def test_the_read_follows_the_producers_stream_order():
    # the dispatcher's side stream waits for the compute stream, then reads: values produced just before must show
    for _ in range(20):
        counts = torch.zeros(64, device="cuda", dtype=torch.int64)
        torch.cuda._sleep(200_000)  # the producer is late on the compute stream
        counts += 7
        assert _read_on_side_stream(counts).tolist() == [7] * 64
