"""Run benchmarks/pretrain_gpt.py under a device-memory cap (``CAP_MIB``): the caching allocator may then hold at
most that much, so a block still being copied out (handed over with ``record_stream`` at a chunk's forward end) is
waited for and reused instead of a new segment being reserved. Session 57, call 6.

    CAP_MIB=4000 torchrun --nproc-per-node 1 benchmarks/results/planner-fused-paths-session57/capped.py FLAGS...
"""

import os
import runpy
import sys
from pathlib import Path

import torch

cap = int(os.environ["CAP_MIB"]) * 2**20
device = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory, device)
script = Path(__file__).resolve().parents[2] / "pretrain_gpt.py"
sys.argv = [str(script), *sys.argv[1:]]
runpy.run_path(str(script), run_name="__main__")
