"""The handler base class: TransformerEngine 2.9's double-buffer handler when TE imports, else ours.

``ChunkOffloadHandler`` derives from TE's ``AsyncDoubleBufferGroupOffloadHandler`` so that it is a drop-in
TE offload handler (same ``tensor_push`` / ``tensor_pop`` / ``on_group_commit_*`` interface). CPU CI and
local-spec users have no TE; :class:`OffloadHandlerBase` gives them the same interface, so there is one
implementation of the logic with two possible bases.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class OffloadHandlerBase:
    """TE's offload-handler interface, for installs without TransformerEngine."""

    def tensor_push(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        raise NotImplementedError

    def tensor_pop(self, tensor_tag: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError

    def on_group_commit_forward(self) -> None:
        raise NotImplementedError

    def on_group_commit_backward(self) -> None:
        raise NotImplementedError

    def groupid_reset(self) -> None:
        raise NotImplementedError


def _te_base() -> type | None:
    try:
        from transformer_engine.pytorch.cpu_offload import AsyncDoubleBufferGroupOffloadHandler
    except Exception as exc:  # ImportError, or a broken TE build (missing .so, CUDA mismatch)
        logger.debug("TransformerEngine handler unavailable (%s); using mcore-offload's base", exc)
        return None
    return AsyncDoubleBufferGroupOffloadHandler


TE_HANDLER_BASE = _te_base()
HandlerBase: type = TE_HANDLER_BASE if TE_HANDLER_BASE is not None else OffloadHandlerBase
