"""mcore-offload: fine-grained, per-module activation offloading for megatron-core 0.15.x.

Users set ``TransformerConfig(fine_grained_activation_offloading=True, offload_modules=[...])`` on a
megatron-core patched with ``mcore-offload patch apply``; the patched code calls into this package.
"""

from mcore_offload.config import OFFLOAD_MODULES, validate_offload_config
from mcore_offload.patching.sites import NotPatchedError, ensure_patched
from mcore_offload.summary import gather_summaries, get_summary

__version__ = "0.1.0"

__all__ = [
    "OFFLOAD_MODULES",
    "NotPatchedError",
    "ensure_patched",
    "gather_summaries",
    "get_summary",
    "paused",
    "validate_offload_config",
    "__version__",
]


def __getattr__(name: str):
    # ``paused`` lives with the runtime, which imports torch; the planning CLI must not (lazy attribute)
    if name == "paused":
        from mcore_offload.runtime.manager import paused

        return paused
    raise AttributeError(f"module 'mcore_offload' has no attribute {name!r}")
