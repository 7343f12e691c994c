"""Runtime check that the megatron-core on ``sys.path`` carries every patch site.

Each patch that inserts offload points also imports ``mcore_offload.runtime.points`` at the top of the
module it patches, under the name ``_mcore_offload_points``; that import is the marker looked for here.
The config patch is recognised by the ``fine_grained_activation_offloading`` dataclass field.
"""

from __future__ import annotations

import dataclasses
import importlib

from mcore_offload.config import PATCH_COMMAND

#: module -> the concern its patch carries (kept in step with patches/megatron-core-*/README.md)
POINT_SITES: dict[str, str] = {
    "megatron.core.transformer.transformer_layer": "attn_norm / mlp_norm points",
    "megatron.core.transformer.attention": "qkv_linear / core_attn / attn_proj points",
    "megatron.core.transformer.moe.experts": "expert_fc1 / moe_act points (TEGroupedMLP)",
    "megatron.core.transformer.mlp": "expert_fc1 / moe_act points (SequentialMLP experts)",
    "megatron.core.models.gpt.gpt_model": "model-chunk registration",
    "megatron.core.pipeline_parallel.schedules": "end-of-step reset",
}

MARKER = "_mcore_offload_points"


class NotPatchedError(RuntimeError):
    """The megatron-core in use lacks one or more mcore-offload patch sites."""


def missing_sites() -> list[str]:
    """Names of the patch concerns absent from the imported megatron-core (empty when fully patched)."""
    missing = []
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    if "fine_grained_activation_offloading" not in names:
        missing.append("TransformerConfig fields")
    for module_name, concern in POINT_SITES.items():
        module = importlib.import_module(module_name)
        if not hasattr(module, MARKER):
            missing.append(f"{concern} ({module_name})")
    return missing


def ensure_patched() -> None:
    """Raise :class:`NotPatchedError` with the fixing command unless every patch site is present."""
    missing = missing_sites()
    if missing:
        import megatron.core as mc

        raise NotPatchedError(
            f"megatron-core {mc.__version__} at {mc.__path__[0]} is not patched for mcore-offload "
            f"(missing: {'; '.join(missing)}); run `{PATCH_COMMAND}` and restart."
        )
