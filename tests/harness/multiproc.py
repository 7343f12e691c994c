"""Launch an N-process gloo job on CPU and bring each rank's return value (or error) back.

Workers are started with the ``spawn`` start method (no fork of a process that has already run
torch/OpenMP code). Each worker joins a gloo process group on ``127.0.0.1:<free port>`` (rank 0
hosts the ``TCPStore``), then calls ``fn(rank, world_size, *args, **kwargs)``; ``fn`` typically
calls :func:`tests.harness.gpt.init_parallel` with ``pp``/``vpp`` (which finds the process group
already up and only initialises megatron's parallel state). Return values travel back through
``torch.save`` files, so they may hold tensors and any importable picklable type.

``fn`` must be importable by the children (a module-level function of an importable module).
Children receive the parent's ``sys.path`` (``spawn`` does that), so a patched megatron-core copy
placed first on ``sys.path`` in the parent is the one the workers import.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["MultiprocessError", "run_multiprocess"]


class MultiprocessError(RuntimeError):
    """A worker raised, died, or the job timed out; the message holds every rank's traceback."""


def _worker(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    num_threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Child entry point: init gloo, run ``fn``, save its result or traceback, tear down."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(num_threads)
    out = Path(out_dir)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=(rank == 0), timeout=timedelta(seconds=60)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        result = fn(rank, world_size, *args, **kwargs)
        torch.save(result, out / f"rank{rank}.pt.tmp")
        os.replace(out / f"rank{rank}.pt.tmp", out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:  # noqa: BLE001 - best-effort cleanup in a dying child
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect_errors(out: Path, procs: list[Any], reason: str) -> MultiprocessError:
    """Build one error holding each rank's traceback (or exit code)."""
    parts = [reason]
    for rank, proc in enumerate(procs):
        err = out / f"rank{rank}.err"
        if err.exists():
            parts.append(f"--- rank {rank} raised:\n{err.read_text()}")
        elif proc.exitcode not in (0, None):
            parts.append(f"--- rank {rank} exited with code {proc.exitcode}")
    return MultiprocessError("\n".join(parts))


def run_multiprocess(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
    num_threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` gloo processes.

    Returns the per-rank return values (index = rank). Raises :class:`MultiprocessError` if any
    rank raises or dies (the others are then terminated after a short grace period, since they
    would block in a collective/p2p) or if the job exceeds ``timeout_s``. ``num_threads`` sets
    ``torch.set_num_threads`` in each worker (1 keeps 2 ranks from oversubscribing 2 cores).
    """
    import torch

    from . import require_cpu_only_torch
    from .gpt import find_free_port

    require_cpu_only_torch()

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="mcore_mp_") as tmp:
        out = Path(tmp)
        port = find_free_port()
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, tmp, num_threads, fn, args, kwargs or {}),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        failure: str | None = None
        try:
            while any(proc.is_alive() for proc in procs):
                if any(proc.exitcode not in (0, None) for proc in procs):
                    failure = "a worker failed"
                    grace = time.monotonic() + 5.0
                    while time.monotonic() < grace and any(p.is_alive() for p in procs):
                        time.sleep(0.05)
                    break
                if time.monotonic() > deadline:
                    failure = f"timed out after {timeout_s:.0f} s"
                    break
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        if failure is None and any(proc.exitcode != 0 for proc in procs):
            failure = "a worker failed"
        if failure is not None:
            raise _collect_errors(out, procs, failure)
        return [
            torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)
        ]
