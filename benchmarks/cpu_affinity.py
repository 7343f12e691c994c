"""Bind a benchmark rank to CPU cores (``pretrain_gpt.py --cpu-bind``).

A launch-bound step (config A on an H100) runs at the speed of the host thread that launches its kernels,
so where the scheduler puts that thread moves step times between runs (measured 100 vs 127 ms for the same
baseline, one run after the other). Megatron users bind ranks with ``numactl``; this does the same from
inside the process, before CUDA starts its threads (they inherit the mask):

- ``gpu-local``: every core of the GPU's NUMA node (the PCI device's ``local_cpulist`` in sysfs);
- ``compact``: ``cores`` consecutive cores of that list per local rank (rank 0 the first block, ...);
- ``none``: leave the mask as it is.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus(device_index: int) -> list[int] | None:
    """The cores of the GPU's NUMA node that this process may use (None where sysfs does not say)."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    path = Path("/sys/bus/pci/devices") / bus / "local_cpulist"
    try:
        listed = parse_cpulist(path.read_text())
    except (OSError, ValueError):
        return None
    allowed = os.sched_getaffinity(0)
    return [c for c in listed if c in allowed] or None


def bind(mode: str, local_rank: int, cores: int) -> list[int]:
    """Apply ``mode`` to this process; return the resulting CPU list (for the results JSON)."""
    if mode != "none":
        local = gpu_local_cpus(local_rank)
        if local is None:
            logger.warning("--cpu-bind %s: the GPU's local CPU list is unknown; binding to every allowed core", mode)
            local = sorted(os.sched_getaffinity(0))
        if mode == "compact":
            block = local[local_rank * cores:(local_rank + 1) * cores]
            if len(block) < cores:
                raise ValueError(f"--cpu-bind compact needs {cores} cores per rank, but the GPU's node has "
                                 f"{len(local)}; lower --cpu-bind-cores or use --cpu-bind gpu-local.")
            local = block
        os.sched_setaffinity(0, local)
    return sorted(os.sched_getaffinity(0))
