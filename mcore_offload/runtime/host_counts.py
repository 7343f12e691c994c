"""MoE token counts read on the host without queueing behind the offload's copies.

megatron-core's all-to-all token dispatcher copies its token counts to the host once per MoE layer and microbatch
(``_maybe_dtoh_and_synchronize``: non-blocking copies on a side stream, then an event the host waits for). Those
copies run on the copy engine that moves device-to-host data, and there they queue behind an offload burst issued
before them on another stream: a 128-byte read waited 2.3 ms behind a 128 MiB burst, in 1, 4 or 16 copies
(session 9, ``benchmarks/gpu/d2h_contention.py``). In a launch-bound step the host's wait is step time: with the
five C points on a fast host, an offloaded step's main thread spent about 70 ms more CPU than a plain one, against
10 ms of runtime clock (session 83).

While offloading is on, :func:`counts_reader` hands the dispatcher :func:`counts_to_host` instead of megatron's
``maybe_move_tensor_to_cpu``: the counts go into pinned host memory through an elementwise kernel that writes the
buffer at its mapped address (pinned memory is mapped into the device's address space under unified addressing), so
no copy engine is involved and nothing is queued ahead. The host reads them after the dispatcher's own event, as
before; kernel completion makes its writes to mapped memory visible. The values are the same integers, so no number
changes. Where the kernel cannot be used (a dtype other than an integer, a pointer the device does not map at the
same address), megatron's copy runs. ``MCORE_OFFLOAD_KERNEL_COUNTS=0`` keeps megatron's copies throughout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from mcore_offload.config import choice_env

logger = logging.getLogger(__name__)

#: integer dtypes the kernel copies exactly (``x + 0``); the dispatcher's counts are int64
_EXACT_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})

_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1"}


def kernel_counts_enabled() -> bool:
    """``MCORE_OFFLOAD_KERNEL_COUNTS``: 1 (default) reads the dispatcher's counts with a kernel while offloading, 0
    keeps megatron's copies (for comparisons)."""
    return choice_env("MCORE_OFFLOAD_KERNEL_COUNTS", "1", ("0", "1"),
                      "0 or 1: set it to 0 for megatron's own copies of the token counts, or unset it") == "1"


def _megatron_copy() -> Callable[..., Any]:
    from megatron.core.transformer.moe.moe_utils import maybe_move_tensor_to_cpu

    return maybe_move_tensor_to_cpu


def counts_reader(config: Any) -> Callable[..., Any]:
    """What the patched dispatcher calls in place of ``maybe_move_tensor_to_cpu``: :func:`counts_to_host` where
    ``config`` offloads and the switch is on, megatron's function otherwise (no change without offloading)."""
    if getattr(config, "fine_grained_activation_offloading", False) and kernel_counts_enabled():
        return counts_to_host
    return _megatron_copy()


class _MappedView:
    """``__cuda_array_interface__`` of a pinned host buffer at its own address: what ``torch.as_tensor`` turns into a
    CUDA tensor over the same memory (no copy)."""

    def __init__(self, host: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": _TYPESTR[host.dtype],
                                         "data": (host.data_ptr(), False), "strides": None, "version": 3,
                                         "stream": None}


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor on ``device`` over the pinned ``host`` buffer's memory, or None where the device does not map it
    at the same address (then the caller copies as megatron does)."""
    if host.numel() == 0:
        return None
    try:
        alias = torch.as_tensor(_MappedView(host), device=device)
    except (RuntimeError, TypeError, ValueError) as e:  # an unregistered pointer, another device's memory
        logger.debug("kernel count read unavailable (%s); copying as megatron does", e)
        return None
    if alias.data_ptr() != host.data_ptr() or alias.device != device:
        return None  # as_tensor copied: not the same memory
    return alias


def counts_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``maybe_move_tensor_to_cpu``'s contract (a CUDA tensor comes back as a host tensor, or a NumPy array with
    ``as_numpy``; anything else unchanged), its values written into pinned memory by a kernel on the current stream.
    Ready once that stream's later event has completed, as the dispatcher's copies were."""
    if not (torch.is_tensor(tensor) and tensor.is_cuda) or tensor.dtype not in _EXACT_DTYPES:
        return _megatron_copy()(tensor, as_numpy=as_numpy, record_stream=record_stream)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    alias = device_alias(host, tensor.device)
    if alias is None:
        return _megatron_copy()(tensor, as_numpy=as_numpy, record_stream=record_stream)
    # An elementwise kernel, not copy_: a same-dtype contiguous copy_ becomes cudaMemcpyAsync, a copy-engine job.
    torch.add(tensor, 0, out=alias)
    if record_stream:
        # the dispatcher's copies run on its side stream: the source must outlive the kernel there
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
    return host.numpy() if as_numpy else host
