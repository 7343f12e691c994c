"""State a run can take on before its first step, with no offloading at all: what of ours' lasting state, if any,
slows the plain steps of a run in which ours has been active (session 25, D-dense on 2x H200).

- ``--spare-streams N``: N streams from PyTorch's pool, never used (ours takes two for its copies, before the
  pipeline's first send or receive makes NCCL take its own from the same pool);
- ``--pin-host-gib G``: G GiB of pinned host memory, held and never used (ours holds its host buffers for the run);
- ``--touch-transport``: ours' transport for the device made without offloading anything (its streams, event pools
  and the CUDA runtime bindings), with ``--offload-paused``.

Benchmark tooling only: the library never imports this module.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def take_probes(device: torch.device, spare_streams: int, pin_host_gib: float, touch_transport: bool) -> list:
    """Take what the arguments name on ``device``; returns what must stay referenced for the run."""
    held: list = []
    if device.type != "cuda":  # nothing to take on a CPU run (the CPU tests check the bookkeeping only)
        return held
    for _ in range(spare_streams):
        torch.cuda.Stream(device=device)  # pooled streams are never given back: no reference needed
    if pin_host_gib > 0:
        held.append(torch.empty(int(pin_host_gib * 2**30), dtype=torch.uint8, pin_memory=True))
    if touch_transport:
        from mcore_offload.runtime.transport import transport_for

        held.append(transport_for(device))
    if spare_streams or pin_host_gib or touch_transport:
        logger.info("state probes: %d spare streams, %.1f GiB pinned, transport %s", spare_streams, pin_host_gib,
                    "made" if touch_transport else "not made")
    return held
