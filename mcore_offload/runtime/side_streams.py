"""Where the runtime's two copy streams come from (``MCORE_OFFLOAD_SIDE_STREAMS``).

``torch.cuda.Stream()`` hands out PyTorch's pooled streams in turn, and so does ProcessGroupNCCL for its own streams.
The driver spreads streams over ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (8 by default), and work on two
streams that share a queue can wait for each other. Our streams are made in the first offloading forward, before the
pipeline's first send or receive creates NCCL's, so they move every later stream to another queue than it had
without us. Session 25 (D-dense, 2x H200) found plain steps about 5 ms slower in every run whose runtime had been
active, also long after offloading stopped, and not in runs where it never was; whether the queues are why is what
the kinds below let a benchmark test:

- ``pool`` (default): two pooled streams, as PyTorch hands them out;
- ``aligned``: as many pooled streams as there are hardware queues, the first two used: every later pooled stream
  lands where it would have without us;
- ``high-priority``: two streams of PyTorch's high-priority pool, which NCCL does not use by default.
"""

from __future__ import annotations

import logging
import os

import torch

from mcore_offload.config import choice_env

logger = logging.getLogger(__name__)

SIDE_STREAM_KINDS = ("pool", "aligned", "high-priority")
DEFAULT_HARDWARE_QUEUES = 8  # CUDA_DEVICE_MAX_CONNECTIONS when unset


def side_stream_kind() -> str:
    """``MCORE_OFFLOAD_SIDE_STREAMS``, one of :data:`SIDE_STREAM_KINDS` (default ``pool``)."""
    return choice_env("MCORE_OFFLOAD_SIDE_STREAMS", "pool", SIDE_STREAM_KINDS,
                      "a side-stream kind: set it to 'pool' (the default), 'aligned' or 'high-priority', or unset it")


def hardware_queues() -> int:
    """The hardware queues the driver spreads streams over (``CUDA_DEVICE_MAX_CONNECTIONS``, 1-32)."""
    raw = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")
    try:
        value = int(raw)
    except ValueError:
        return DEFAULT_HARDWARE_QUEUES
    return min(max(value, 1), 32)


def make_side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """The D2H and H2D streams of ``device``, of the kind ``MCORE_OFFLOAD_SIDE_STREAMS`` names."""
    kind = side_stream_kind()
    if kind == "high-priority":
        streams = [torch.cuda.Stream(device=device, priority=-1) for _ in range(2)]
    else:
        # Pooled streams are never destroyed: the ones taken and not used need no reference.
        count = max(2, hardware_queues()) if kind == "aligned" else 2
        streams = [torch.cuda.Stream(device=device) for _ in range(count)]
    logger.debug("side streams on %s: %s (%d taken)", device, kind, len(streams))
    return streams[0], streams[1]
