"""Test-only shims that let megatron-core 0.15.3 run on a CPU-only torch build.

Nothing here edits megatron-core's files: every shim is a monkeypatch recorded in a registry so
that :func:`remove_cpu_shims` can put the originals back. megatron is imported lazily inside
:func:`install_cpu_shims`, so a patched megatron-core copy placed first on ``sys.path`` is the one
that gets shimmed (import the harness, fix ``sys.path``, then install).

Three kinds of shim:

* method/function replacements (``GlobalMemoryBuffer.get_tensor``, the RNG tracker, the seeding
  helpers) whose CUDA-only bodies have a natural CPU equivalent;
* a stub for a name megatron reads but only defines when transformer-engine imports
  (``moe_utils.te_general_gemm``);
* a ``torch`` stand-in (:class:`_TorchOnCpu`) bound as the global name ``torch`` inside the few
  megatron modules listed in :data:`TORCH_PROXY_MODULES`. In those modules only, factory calls
  with ``device="cuda"``/an int device allocate on CPU, ``torch.cuda.current_device()`` answers
  ``cpu`` and ``torch.cuda.synchronize()`` is a no-op. ``torch`` itself is never modified, so
  code elsewhere (e.g. an offloading implementation under test) still sees the real CPU build.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import operator
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "TORCH_PROXY_MODULES",
    "cpu_shims",
    "install_cpu_shims",
    "remove_cpu_shims",
    "shims_installed",
]

_CPU = torch.device("cpu")

# Two copies of this module (imported as ``harness.cpu_shims`` and ``tests.harness.cpu_shims``)
# would keep two registries and record each other's shims as "originals".
if {"harness.cpu_shims", "tests.harness.cpu_shims"} - {__name__} & sys.modules.keys():
    raise ImportError(
        f"{__name__}: the CPU shims are already imported under another name; import the"
        " harness under one package name only (tests.harness)"
    )

#: megatron modules whose global ``torch`` is replaced by :class:`_TorchOnCpu`, with the reason
#: (line numbers are from the 0.15.3 wheel).
TORCH_PROXY_MODULES: dict[str, str] = {
    "megatron.core.pipeline_parallel.schedules": (
        "every schedule allocates total_num_tokens with torch.zeros(..., device='cuda')"
        " (L573, L963, L2114)"
    ),
    "megatron.core.pipeline_parallel.p2p_communication": (
        "receive/shape buffers are allocated on torch.cuda.current_device() (L190-202, L313,"
        " L321) and torch.cuda.synchronize() follows batch_isend_irecv (L242, L398)"
    ),
    "megatron.core.transformer.utils": (
        "get_default_causal_mask / get_sliding_window_causal_mask build masks with"
        " device='cuda' (L35, L41); the unfused softmax of local attention uses them"
    ),
    "megatron.core.models.common.embeddings.rotary_pos_embedding": (
        "RoPE moves inv_freq to torch.cuda.current_device() on first forward (L164, L272)"
    ),
    "megatron.core.transformer.moe.router": (
        "expert-bias / global-aux-loss buffers are created on torch.cuda.current_device()"
        " (L165-194)"
    ),
    "megatron.core.transformer.moe.moe_utils": (
        "the MoE metrics tracker is created with torch.zeros(..., device='cuda') (L801) by"
        " track_moe_metrics(force_initialize=True); precautionary, run_steps does not reach it"
    ),
}

# Factory functions whose ``device=`` argument is remapped to CPU inside proxied modules.
_FACTORIES = frozenset(
    {
        "arange",
        "empty",
        "empty_like",
        "full",
        "full_like",
        "ones",
        "ones_like",
        "rand",
        "randint",
        "randn",
        "tensor",
        "zeros",
        "zeros_like",
    }
)

# (owner, attribute name, original value or _MISSING) for every installed patch, in order.
_PATCHES: list[tuple[Any, str, Any]] = []
_MISSING = object()


def _cpu_device(device: Any) -> Any:
    """Map a CUDA device spec ("cuda", "cuda:0", torch.device("cuda"), an int) to CPU."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _NullStream:
    """Stand-in for a CUDA stream/event on CPU: everything is already synchronous."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        """Nothing to wait for on CPU."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for on CPU."""

    def record_event(self, event: Any = None) -> _NullStream:
        """Return an event-like object that is always complete."""
        return _NullStream()

    def record(self, stream: Any = None) -> None:
        """Recording an event is a no-op on CPU."""

    def synchronize(self) -> None:
        """Nothing to synchronize on CPU."""

    def query(self) -> bool:
        """Always complete."""
        return True


class _CudaOnCpu:
    """``torch.cuda`` as seen from a proxied module: device queries answer CPU, syncs do nothing."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        """Allocations ``device=torch.cuda.current_device()`` land on CPU."""
        return _CPU

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """CPU ops (and gloo p2p after ``req.wait()``) are already complete."""

    @staticmethod
    def current_stream(device: Any = None) -> _NullStream:
        """There are no streams on CPU."""
        return _NullStream()

    Stream = _NullStream
    Event = _NullStream

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager[None]:
        """Entering a stream context is a no-op on CPU."""
        return contextlib.nullcontext()


class _TorchOnCpu:
    """``torch`` as seen from a proxied module: CUDA factory devices map to CPU; rest delegates."""

    cuda = _CudaOnCpu()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name in _FACTORIES:
            return _remap_factory(attr)
        return attr


@functools.cache
def _remap_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a torch factory so ``device=<cuda>`` allocates on CPU."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


_TORCH_ON_CPU = _TorchOnCpu()


# --------------------------------------------------------------------------------------------
# Function / method replacements
# --------------------------------------------------------------------------------------------


def _global_memory_buffer_get_tensor(
    self: Any,
    tensor_shape: Any,
    dtype: torch.dtype,
    name: str,
    mem_alloc_context: Callable[[], Any] | None = None,
) -> torch.Tensor:
    """GlobalMemoryBuffer.get_tensor: the original allocates on torch.cuda.current_device()."""
    required_len = functools.reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required_len:
        ctx = mem_alloc_context if mem_alloc_context else contextlib.nullcontext
        with ctx():
            self.buffer[(name, dtype)] = torch.empty(
                required_len, dtype=dtype, device=_CPU, requires_grad=False
            )
    return self.buffer[(name, dtype)][0:required_len].view(*tensor_shape)


def _tracker_add(self: Any, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add: track a seeded CPU generator state (no CUDA generator exists)."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _tracker_fork(self: Any, name: str | None = None) -> Iterator[None]:
    """CudaRNGStatesTracker.fork: swap the CPU default generator (what CPU dropout draws from)."""
    if name is None:
        from megatron.core.tensor_parallel import random as mrandom

        name = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME
    if name not in self.states_:
        raise Exception(f"cuda rng state {name} is not added")
    orig_state = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig_state)


def _get_cuda_rng_state(
    device: Any = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    """random._get_cuda_rng_state: no CUDA RNG; callers save the CPU state separately."""
    return torch.empty(0, dtype=torch.uint8)


def _set_cuda_rng_state(
    new_state: torch.Tensor, device: int = -1, graph_safe: bool = False
) -> None:
    """random._set_cuda_rng_state: no CUDA RNG to restore (the CPU state is restored by callers)."""


def _model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    force_reset_rng: bool = False,
) -> None:
    """model_parallel_cuda_manual_seed: seeds the CPU generator where the original seeds CUDA."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    mrandom.initialize_rng_tracker(
        te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng, force_reset=force_reset_rng
    )
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


# --------------------------------------------------------------------------------------------
# Install / remove
# --------------------------------------------------------------------------------------------


def _patch(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name = value`` and remember the original for :func:`remove_cpu_shims`."""
    _PATCHES.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, value)


def shims_installed() -> bool:
    """Whether :func:`install_cpu_shims` is in effect."""
    return bool(_PATCHES)


def install_cpu_shims() -> None:
    """Install every CPU shim (idempotent: a second call while installed does nothing)."""
    if _PATCHES:
        return
    from megatron.core import tensor_parallel
    from megatron.core import utils as mutils
    from megatron.core.tensor_parallel import random as mrandom

    try:
        _patch(mutils.GlobalMemoryBuffer, "get_tensor", _global_memory_buffer_get_tensor)
        _patch(mrandom.CudaRNGStatesTracker, "add", _tracker_add)
        _patch(mrandom.CudaRNGStatesTracker, "fork", _tracker_fork)
        _patch(mrandom, "_get_cuda_rng_state", _get_cuda_rng_state)
        _patch(mrandom, "_set_cuda_rng_state", _set_cuda_rng_state)
        _patch(mrandom, "model_parallel_cuda_manual_seed", _model_parallel_cuda_manual_seed)
        _patch(tensor_parallel, "model_parallel_cuda_manual_seed", _model_parallel_cuda_manual_seed)
        moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
        if not hasattr(moe_utils, "te_general_gemm"):
            # Without transformer-engine the import of te_general_gemm fails (L11-28) but
            # RouterGatingLinearFunction still reads the name (L958, L982): NameError.
            _patch(moe_utils, "te_general_gemm", None)
        for module_name in TORCH_PROXY_MODULES:
            _patch(importlib.import_module(module_name), "torch", _TORCH_ON_CPU)
    except BaseException:
        remove_cpu_shims()
        raise


def remove_cpu_shims() -> None:
    """Restore every original replaced by :func:`install_cpu_shims` (no-op if none installed)."""
    while _PATCHES:
        owner, name, original = _PATCHES.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Context manager: install the shims for the block, then remove them if it installed them."""
    already = shims_installed()
    install_cpu_shims()
    try:
        yield
    finally:
        if not already:
            remove_cpu_shims()
