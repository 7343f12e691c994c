"""The offload configuration surface: the names users put in ``TransformerConfig`` and their validation.

The three fields (``fine_grained_activation_offloading``, ``offload_modules``, ``min_offloaded_tensor_size``)
carry upstream megatron-core >= 0.16's names, types and defaults so that a config moves between versions
unchanged. The patched ``TransformerConfig.__post_init__`` calls :func:`validate_offload_config`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

#: The named offload points, in the order they run inside one transformer layer.
OFFLOAD_MODULES: tuple[str, ...] = (
    "attn_norm",
    "qkv_linear",
    "core_attn",
    "attn_proj",
    "mlp_norm",
    "expert_fc1",
    "moe_act",
)

#: Upstream's default for ``min_offloaded_tensor_size`` (elements).
DEFAULT_MIN_OFFLOADED_TENSOR_SIZE: int = 1024 * 1024

PATCH_COMMAND = "mcore-offload patch apply"


def _allowed() -> str:
    return ", ".join(OFFLOAD_MODULES)


def validate_offload_modules(modules: Sequence[str]) -> list[str]:
    """Return ``modules`` as a list after checking every name; raise ``ValueError`` on an unknown one."""
    if isinstance(modules, str):
        raise ValueError(
            f"offload_modules must be a list of names, not the string {modules!r}; "
            f"write offload_modules=[{modules!r}]."
        )
    names = list(modules)
    from mcore_offload.runtime.auto import auto_settings, parse_auto

    if parse_auto(names) is not False:  # ["auto"] / ["auto:<GiB>"], checked there
        auto_settings()  # and auto's environment variables, before anything runs
        return names
    unknown = [m for m in names if m not in OFFLOAD_MODULES]
    if unknown:
        raise ValueError(
            f"Unknown offload module(s) {unknown}: choose from {_allowed()}, or use ['auto'] / ['auto:<GiB>']."
        )
    return names


def full_recompute_of_every_layer(config: Any) -> bool:
    """Whether megatron's full recompute checkpoints every layer of every model chunk."""
    if getattr(config, "recompute_granularity", None) != "full":
        return False
    method = getattr(config, "recompute_method", None)
    if method == "uniform":
        return True
    if method != "block" or getattr(config, "num_layers_in_first_pipeline_stage", None) is not None \
            or getattr(config, "num_layers_in_last_pipeline_stage", None) is not None:
        return False  # uneven stages: some chunk may run layers without recompute
    chunks = (getattr(config, "pipeline_model_parallel_size", 1) or 1) * (
        getattr(config, "virtual_pipeline_model_parallel_size", None) or 1)
    per_chunk = -(-int(config.num_layers) // chunks)
    return int(getattr(config, "recompute_num_layers", 0) or 0) >= per_chunk


def full_recompute_message(method: str | None) -> str:
    """The one-sentence refusal of offloading under full recompute of every layer."""
    return ("fine_grained_activation_offloading has nothing to offload when full recompute covers every layer "
            f"(recompute_granularity='full', recompute_method={method!r}: no layer's forward saves activations, "
            "and recompute in backward is never offloaded); use selective recompute, recompute_method='block' "
            "with fewer layers, or turn offloading off.")


def selectively_recomputed(config: Any) -> set[str]:
    """The selective-recompute modules megatron-core will use; this runs before its ``__post_init__`` fills the
    default (``None`` means ``["core_attn"]``) and turns the deprecated ``moe_layer_recompute`` into ``"moe"``."""
    modules: set[str] = set()
    if getattr(config, "recompute_granularity", None) == "selective":
        listed = getattr(config, "recompute_modules", None)
        modules.update(["core_attn"] if listed is None else listed)
    if getattr(config, "moe_layer_recompute", False):
        modules.add("moe")
    return modules


_NOTHING_SAVED = "runs it under a checkpoint whose forward saves nothing for backward, so it would offload nothing"
# CheckpointWithoutOutput reads its inputs' .grad in backward; under any saved-tensor hooks (offloading's
# mechanism) PyTorch hands back new tensor objects on unpack, whose .grad stays None: the gradient into the
# checkpoint's input is lost (loss diverged from the baseline on the GPU host; tests/test_offload_recompute.py).
_WRONG_GRADIENT = ("runs it under CheckpointWithoutOutput, whose backward loses its input's gradient while "
                   "saved-tensor hooks (how offloading works) are active around it, so gradients would be wrong")
#: (offload point, selective-recompute module) -> why they cannot be combined
_CONFLICT_REASONS: dict[tuple[str, str], str] = {
    ("core_attn", "core_attn"): _NOTHING_SAVED,
    ("expert_fc1", "moe"): _NOTHING_SAVED,
    ("moe_act", "moe"): _NOTHING_SAVED,
    ("attn_norm", "layernorm"): _WRONG_GRADIENT,
    ("mlp_norm", "layernorm"): _WRONG_GRADIENT,
    ("moe_act", "moe_act"): _WRONG_GRADIENT,
}


def attn_proj_alone_frees_nothing(names: Iterable[str], recomputed: Iterable[str], fp8: bool) -> bool:
    """Whether ``names`` has attn_proj without core_attn where core attention's backward saves the same tensor.
    attn_proj frees something alone under core_attn recompute (the checkpoint keeps no output) and under FP8 (TE's
    projection saves its own FP8 copy of the output)."""
    names = set(names)
    return "attn_proj" in names and "core_attn" not in names and "core_attn" not in set(recomputed) and not fp8


def attn_proj_frees_alone(recomputed: Iterable[str], fp8: bool) -> bool:
    """Whether attn_proj frees memory without core_attn (FP8 or core_attn recompute): where it does, the planner and
    ``auto`` treat it as a point of its own, where it does not, only together with core_attn."""
    return not attn_proj_alone_frees_nothing(("attn_proj",), recomputed, fp8)


def recompute_conflicts(recomputed: set[str] | frozenset[str]) -> dict[str, str]:
    """Offload points that selective recompute of the ``recomputed`` modules rules out, each with its module.
    Explicit names are refused; ``auto`` leaves these points out."""
    return {point: module for point, module in _CONFLICT_REASONS if module in recomputed}


def recompute_conflict_message(point: str, module: str) -> str:
    """The one-sentence refusal of offloading ``point`` under selective recompute of ``module``."""
    return (f"offload_modules has '{point}', but selective recompute of '{module}' (recompute_modules) "
            f"{_CONFLICT_REASONS[(point, module)]}; drop '{point}' from offload_modules or '{module}' "
            "from recompute_modules.")


def validate_offload_config(config: Any) -> None:
    """Check the offload fields of a megatron-core ``TransformerConfig``; raise one actionable ``ValueError``.

    Called from the patched ``TransformerConfig.__post_init__``. Fields are read with ``getattr`` so that
    the function also accepts any object with the same attribute names (tests, launch scripts).
    """
    enabled = bool(getattr(config, "fine_grained_activation_offloading", False))
    modules = getattr(config, "offload_modules", None)
    if modules is None:
        modules = []
    min_size = getattr(config, "min_offloaded_tensor_size", DEFAULT_MIN_OFFLOADED_TENSOR_SIZE)

    if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 0:
        raise ValueError(
            f"min_offloaded_tensor_size must be a non-negative number of elements, got {min_size!r}; "
            f"use 0 to offload every activation or keep the default {DEFAULT_MIN_OFFLOADED_TENSOR_SIZE}."
        )
    names = validate_offload_modules(modules)
    if not enabled:
        return
    if not names:
        raise ValueError(
            "fine_grained_activation_offloading=True needs at least one name in offload_modules: "
            f"choose from {_allowed()}."
        )
    recomputed = selectively_recomputed(config)
    for point, module in recompute_conflicts(recomputed).items():
        if point in names:
            raise ValueError(recompute_conflict_message(point, module))
    if attn_proj_alone_frees_nothing(names, recomputed, bool(getattr(config, "fp8", None))):
        raise ValueError(
            "offload_modules has 'attn_proj' without 'core_attn': core attention's backward saves the "
            "same tensor, so offloading attn_proj alone frees nothing; add 'core_attn' or drop 'attn_proj'."
        )
    if ("expert_fc1" in names and getattr(config, "fp8", None) and getattr(config, "num_moe_experts", None)
            and getattr(config, "moe_grouped_gemm", False)):
        # Seen on the GPU host (TE 2.9, delayed scaling): GroupedLinear quantizes its inputs as Float8Tensor
        # subclasses (its quantizers are not "internal"), which the handler leaves on the device.
        raise ValueError(
            "offload_modules has 'expert_fc1', but with FP8 TransformerEngine's grouped GEMM "
            "(moe_grouped_gemm=True) saves the experts' inputs as Float8Tensor objects, which are not offloaded, "
            "so expert_fc1 would offload nothing; drop 'expert_fc1' (moe_act still offloads) or run without FP8."
        )
    if getattr(config, "cpu_offloading", False):
        raise ValueError(
            "fine_grained_activation_offloading and cpu_offloading (TransformerEngine's layer-level "
            "offloading) cannot be enabled together; set cpu_offloading=False."
        )

    if full_recompute_of_every_layer(config):
        raise ValueError(full_recompute_message(config.recompute_method))
    graphs = [f for f in ("enable_cuda_graph", "external_cuda_graph") if getattr(config, f, False)]
    if getattr(config, "cuda_graph_impl", "none") not in (None, "none"):
        graphs.append(f"cuda_graph_impl={config.cuda_graph_impl!r}")
    if graphs:
        raise ValueError(
            f"fine_grained_activation_offloading cannot be combined with CUDA graphs ({', '.join(graphs)}): "
            "a replayed graph skips the saved-tensor hooks that track each offloaded tensor; "
            "disable CUDA graphs or offloading."
        )

    # A config patch without the offload-point patches would silently offload nothing.
    from mcore_offload.patching.sites import ensure_patched

    ensure_patched()


def choice_env(name: str, default: str, choices: tuple[str, ...], advice: str | None = None) -> str:
    """Environment variable ``name``, one of ``choices`` (``default`` when unset); anything else is one sentence,
    ``"<name>=<value> is not "`` followed by ``advice`` (default: the choices, and to unset it)."""
    value = os.environ.get(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not "
                         + (advice or f"one of {', '.join(choices)}; unset it for the default ({default})"))
    return value


def nonnegative_float_env(name: str, default: float, advice: str) -> float:
    """Environment variable ``name`` as a finite float of at least 0 (``default`` when unset); a bad value is one
    clear sentence ending with ``advice``."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise ValueError(f"{name}={raw!r} is not a number of at least 0; {advice}")
    return value


def positive_int_env(name: str, default: int, advice: str) -> int:
    """Environment variable ``name`` as a positive int (``default`` when unset); a bad value is one clear sentence
    ending with ``advice`` (what to set instead)."""
    raw = os.environ.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name}={raw!r} is not a positive integer; {advice}")
    return value
