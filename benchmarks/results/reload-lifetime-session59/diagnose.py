"""Session 59: what the device holds inside an offloaded group's backward, on the toy of tests/test_reload_lifetime.py
(two layers of three tanhs, 64 + 128 + 192 MiB saved a layer; the first layer offloaded), on CUDA.

For no offloading, ours with the C++ hooks, ours with the Python hooks, and ours with the Python hooks holding every
reloaded storage to its group's end (the runtime before session 59, emulated): the allocated bytes above the run's
start at four moments of backward, and the step's counters. Then, for ours (C++ hooks), the live blocks of 16 MiB or
more at the first layer's middle moment, with the Python frames that allocated them.

    python3 benchmarks/results/reload-lifetime-session59/diagnose.py > OUT.txt
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from mcore_offload.runtime.handler import ChunkOffloadHandler  # noqa: E402
from mcore_offload.runtime.manager import reset  # noqa: E402
from mcore_offload.summary import get_summary  # noqa: E402
from tests.test_reload_lifetime import run_three_readers  # noqa: E402

MiB = 2**20
ROWS = 2**20


def held_to_group_end(ref, entry):  # the runtime before session 59: the entry keeps its storage
    ref.unpacked = True


def live_blocks(snapshot, min_bytes=16 * MiB):
    out = []
    for seg in snapshot["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b["size"] >= min_bytes:
                frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in b.get("frames", [])
                          if "torch/" not in f["filename"] and f["filename"].endswith(".py")][:6]
                out.append((b["size"] // MiB, frames))
    return out


def run(label, names, hooks, old=False, snapshot_at=None):
    os.environ["MCORE_OFFLOAD_NATIVE"] = hooks
    saved = ChunkOffloadHandler.__dict__["_first_read"]  # the staticmethod object itself
    if old:
        ChunkOffloadHandler._first_read = staticmethod(held_to_group_end)
    reset()
    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    snaps = {}

    def measure():
        torch.cuda.synchronize()
        return (torch.cuda.memory_allocated() - start) / MiB

    calls = [0]

    def measure_and_snap():
        value = measure()
        calls[0] += 1
        if calls[0] == snapshot_at:
            snaps["layer"] = torch.cuda.memory._snapshot()
        return value

    try:
        model, loss, grad = run_three_readers(names, measure_and_snap if snapshot_at else measure, ROWS, "cuda")
    finally:
        ChunkOffloadHandler._first_read = saved
    step = get_summary().last_step
    counters = {}
    if names and step is not None:
        for c in ("offloaded", "released_in_forward", "released_late", "reloaded", "kept_on_device",
                  "skipped_aliased"):
            counters[c] = step.total(c) / MiB
    print(f"{label}: loss {loss.item()!r}")
    for where, value, _ in model.notes:
        print(f"  {where:45s} {value:9.1f} MiB above the start")
    if counters:
        print("  counters (MiB):", counters)
    result = (loss.item(), grad.clone())
    del model, loss, grad
    return result, snaps


def main():
    print(torch.__version__, torch.cuda.get_device_name())
    base, _ = run("no offloading", [], "1")
    for label, hooks, old in (("ours, C++ hooks", "1", False), ("ours, Python hooks", "0", False),
                              ("ours, Python hooks, held to the group's end (before session 59)", "0", True)):
        got, _ = run(label, ["core_attn"], hooks, old)
        print("  bitwise equal to no offloading:", got[0] == base[0] and torch.equal(got[1], base[1]))
    torch.cuda.memory._record_memory_history(max_entries=200000)
    # the third moment noted in backward: "layer 1: after the second and third tanh"
    _, snaps = run("ours, C++ hooks, snapshot at layer 1 mid-backward", ["core_attn"], "1",
                   snapshot_at=3)
    torch.cuda.memory._record_memory_history(enabled=None)
    print("live blocks >= 16 MiB at that moment (size MiB, allocating frames):")
    for size, frames in live_blocks(snaps["layer"]):
        print(f"  {size:6d}  {' < '.join(frames)}")


if __name__ == "__main__":
    main()
