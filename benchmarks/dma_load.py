"""The offload's PCIe traffic without the offload runtime: what moving the bytes alone costs a step.

``pretrain_gpt.py --dma-load-mib FWD BWD`` copies FWD MiB from a scratch device buffer to a host buffer at the start
of every ``TransformerLayer.forward`` (D2H, on a side stream that first waits for the compute stream, as the
runtime's copy-out does) and BWD MiB from a host buffer to a scratch device buffer when the gradient of the layer's
output arrives (H2D, on a second side stream), in every other step. Each chunk's last layer is left out, as the
runtime leaves it on the device where a chunk's backward comes before any flush (one layer and one chunk); under
pipelining most chunks' last layers are offloaded (D-dense's rank 0: every layer), and ``--dma-load-every-layer``
copies there too. Nothing the model computes reads these buffers, so losses are unchanged.

Set FWD and BWD to an offload set's bytes per layer and microbatch (A ``core_attn``: 48 MiB) and the paired
overhead is the cost of the link traffic itself: the host work the copies slow down (a PCIe transfer slows the
training thread, ``benchmarks/gpu/dma_host_contention.py``) and any HBM contention, with three raw CUDA calls per
copy of host time (timed and reported). The host buffers are the runtime's kind (``MCORE_OFFLOAD_HOST_MEMORY``).

Benchmark tooling only: the library never imports it.
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import Any

import torch
from host_delay import LayerHooks

from mcore_offload.runtime.cudart import DEVICE_TO_HOST, HOST_ALLOC_WRITE_COMBINED, HOST_TO_DEVICE, load_runtime
from mcore_offload.runtime.host_pool import host_memory_kind

_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class DmaLoad(LayerHooks):
    """Copies at every ``TransformerLayer`` but (by default) each chunk's last (:meth:`install`'s ``skip_last``);
    ``active`` switches them (pretrain_gpt.py sets it per step)."""

    def __init__(self, fwd_mib: float, bwd_mib: float, device: torch.device) -> None:
        super().__init__()
        self.fwd_bytes, self.bwd_bytes = int(fwd_mib * 2**20), int(bwd_mib * 2**20)
        self.fwd, self.bwd = self.fwd_bytes, self.bwd_bytes
        self.rt = load_runtime()
        if self.rt is None:
            raise SystemExit("--dma-load-mib needs the CUDA runtime PyTorch has mapped (raw copies)")
        self.memory = host_memory_kind()
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.host_ns = 0
        n = max(self.fwd_bytes, self.bwd_bytes, 1)
        self.src = torch.empty(n, dtype=torch.uint8, device=device)  # read by D2H
        self.dst = torch.empty(n, dtype=torch.uint8, device=device)  # written by H2D
        self.hosts = [self._host(n), self._host(n)]  # D2H target, H2D source
        self.d2h, self.h2d = torch.cuda.Stream(device), torch.cuda.Stream(device)
        self.fence = torch.cuda.Event()  # the compute stream's position at a layer's start

    def _host(self, n: int) -> torch.Tensor:
        if self.memory == "write-combined":
            return self.rt.host_tensor(n, HOST_ALLOC_WRITE_COMBINED)
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def install(self, chunks: list[torch.nn.Module], skip_last: bool = True) -> int:
        """Hook every transformer layer of ``chunks``, each chunk's last too unless ``skip_last``."""
        return super().install(chunks, skip_last)

    def _copy(self, nbytes: int, stream: torch.cuda.Stream, dst: int, src: int, kind: int) -> None:
        t0 = perf_counter_ns()
        rt = self.rt
        compute = _current_raw_stream(self.device_index) if _current_raw_stream else \
            torch.cuda.current_stream().cuda_stream
        handle = self.fence.cuda_event
        if not handle:  # created lazily by its first record
            self.fence.record()
            handle = self.fence.cuda_event
        err = rt.event_record(handle, compute) or rt.stream_wait(stream.cuda_stream, handle, 0)
        if err:
            rt.fail("cudaEventRecord/cudaStreamWaitEvent", err)
        rt.memcpy_async(dst, src, nbytes, kind, stream.cuda_stream)
        self.host_ns += perf_counter_ns() - t0

    def on_forward(self) -> None:
        self._copy(self.fwd_bytes, self.d2h, self.hosts[0].data_ptr(), self.src.data_ptr(), DEVICE_TO_HOST)

    def on_backward(self) -> None:
        self._copy(self.bwd_bytes, self.h2d, self.dst.data_ptr(), self.hosts[1].data_ptr(), HOST_TO_DEVICE)

    def as_dict(self, loaded_steps: int) -> dict[str, Any]:
        per = max(loaded_steps, 1)
        return {"fwd_bytes": self.fwd_bytes, "bwd_bytes": self.bwd_bytes, "layers": self.layers,
                "host_memory": self.memory,
                "fwd_calls_per_loaded_step": self.calls["fwd"] / per,
                "bwd_calls_per_loaded_step": self.calls["bwd"] / per,
                "d2h_bytes_per_loaded_step": self.calls["fwd"] * self.fwd_bytes / per,
                "h2d_bytes_per_loaded_step": self.calls["bwd"] * self.bwd_bytes / per,
                "hook_host_ms_per_loaded_step": self.host_ns / 1e6 / per}
