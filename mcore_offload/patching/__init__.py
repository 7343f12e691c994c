"""Applying, checking and reverting the megatron-core patches (``mcore-offload patch ...``)."""

from mcore_offload.patching.tooling import (
    MegatronInstall,
    PatchError,
    PatchState,
    apply_patches,
    check_patches,
    find_megatron,
    patch_source,
    revert_patches,
    supported_versions,
)

__all__ = [
    "MegatronInstall",
    "PatchError",
    "PatchState",
    "apply_patches",
    "check_patches",
    "find_megatron",
    "patch_source",
    "revert_patches",
    "supported_versions",
]
