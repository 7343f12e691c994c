"""Measure this machine's host link and GEMM rate, for ``mcore-offload plan --hardware-json``.

Why: the planner's presets are one H100's measurements (the H200 borrows them, GB200 is a spec sheet). On any other
machine, or to check a preset, ``mcore-offload measure --json-out hw.json`` times what the planner's overlap model
uses (``plan/hardware.py``): pinned device-to-host and host-to-device copies, both directions at once on two
streams, and a large bf16 GEMM; ``plan --hardware-json hw.json`` then plans with those rates and the device's memory.

Every rate is bytes (or FLOPs) over the CUDA-event time of ``iters`` back-to-back operations after two warm-up ones;
the host copies use pinned memory, as the runtime's pool does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from mcore_offload.plan.hardware import Hardware, LinkSpeed
from mcore_offload.plan.model import PlanError

logger = logging.getLogger(__name__)

MIB = 2**20
WARMUP = 2
#: The JSON's ``format`` field: what ``load_measured`` accepts.
FORMAT = "mcore-offload hardware 1"


@dataclass(frozen=True)
class MeasuredHardware:
    """What ``measure`` found on one GPU, and how."""

    name: str
    d2h_gbps: float
    h2d_gbps: float
    both_gbps: float
    dense_tflops: float
    memory_gib: float
    copy_mib: int
    iters: int
    gemm_size: int
    torch_version: str

    def hardware(self) -> Hardware:
        """The planner's description of this machine."""
        source = (f"measured on {self.name} by mcore-offload measure ({self.copy_mib} MiB pinned copies and a "
                  f"{self.gemm_size}^3 bf16 GEMM, x{self.iters}, torch {self.torch_version})")
        return Hardware(self.name, self.dense_tflops, LinkSpeed(self.d2h_gbps, self.h2d_gbps, self.both_gbps),
                        self.memory_gib, source)

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}


def load_measured(path: str | Path) -> MeasuredHardware:
    """A file written by ``mcore-offload measure --json-out``; one clear error for anything else."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlanError(f"cannot read --hardware-json {path} ({exc.strerror}); write one with "
                        "'mcore-offload measure --json-out PATH' on the machine you plan for.") from None
    except json.JSONDecodeError:
        raise PlanError(f"--hardware-json {path} is not JSON; write one with 'mcore-offload measure --json-out "
                        "PATH'.") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise PlanError(f"--hardware-json {path} was not written by 'mcore-offload measure' (its format field is "
                        f"not {FORMAT!r}); measure again with 'mcore-offload measure --json-out PATH'.")
    fields = {k: v for k, v in doc.items() if k != "format"}
    try:
        measured = MeasuredHardware(**fields)
    except TypeError:
        raise PlanError(f"--hardware-json {path} lacks fields or has unknown ones; measure again with "
                        "'mcore-offload measure --json-out PATH'.") from None
    rates = (measured.d2h_gbps, measured.h2d_gbps, measured.both_gbps, measured.dense_tflops, measured.memory_gib)
    if not all(isinstance(r, (int, float)) and r > 0 for r in rates):
        raise PlanError(f"--hardware-json {path} holds a rate that is not a positive number; measure again with "
                        "'mcore-offload measure --json-out PATH'.")
    return measured


def measure(copy_mib: int = 256, iters: int = 20, gemm_size: int = 8192, device: int | None = None
            ) -> MeasuredHardware:
    """Time pinned D2H, H2D, both at once, and a bf16 GEMM on the current (or given) CUDA device."""
    import torch

    if copy_mib < 1 or iters < 1 or gemm_size < 256:
        raise PlanError(f"--copy-mib and --iters must be at least 1 and --gemm-size at least 256, got {copy_mib}, "
                        f"{iters} and {gemm_size}; the defaults are 256, 20 and 8192.")
    if not torch.cuda.is_available():
        raise PlanError("measuring needs a CUDA GPU and none is visible here; run it on the machine you plan for, "
                        "or describe that machine to plan with --gpu, --link-gbps and --tflops.")
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else device)
    with torch.cuda.device(dev):
        name = torch.cuda.get_device_name(dev)
        logger.info("timing %d MiB pinned copies and a %d^3 bf16 GEMM, x%d each, on %s", copy_mib, gemm_size,
                    iters, name)
        d2h, h2d, both = _link_rates(dev, copy_mib * MIB, iters)
        a, b = (torch.randn(gemm_size, gemm_size, dtype=torch.bfloat16, device=dev) for _ in range(2))
        tflops = 2 * gemm_size**3 * iters / _timed([(torch.cuda.current_stream(dev), lambda: torch.mm(a, b))],
                                                   iters) / 1e12
        memory = torch.cuda.get_device_properties(dev).total_memory / 2**30
    return MeasuredHardware(name, round(d2h, 2), round(h2d, 2), round(both, 2), round(tflops, 1), round(memory, 1),
                            copy_mib, iters, gemm_size, torch.__version__)


def _link_rates(dev, nbytes: int, iters: int) -> tuple[float, float, float]:
    """GB/s of pinned D2H, of H2D, and of both at once (each direction on its own stream, as in the runtime)."""
    import torch

    out_dev, in_dev = (torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2))
    out_host, in_host = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    d2h = (torch.cuda.Stream(dev), lambda: out_host.copy_(out_dev, non_blocking=True))
    h2d = (torch.cuda.Stream(dev), lambda: in_dev.copy_(in_host, non_blocking=True))
    return (nbytes * iters / _timed([d2h], iters) / 1e9, nbytes * iters / _timed([h2d], iters) / 1e9,
            2 * nbytes * iters / _timed([d2h, h2d], iters) / 1e9)


def _timed(work: list, iters: int) -> float:
    """Seconds from a common start to the end of every stream's ``iters`` operations (each stream's work in
    ``work`` as (stream, op)), after ``WARMUP`` untimed operations on each."""
    import torch

    main = torch.cuda.current_stream()
    for stream, op in work:
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                op()
    for stream, _ in work:
        main.wait_stream(stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(main)
    for stream, op in work:
        stream.wait_event(start)  # every stream starts at the same instant: "both" measures the overlap
        with torch.cuda.stream(stream):
            for _ in range(iters):
                op()
    for stream, _ in work:
        main.wait_stream(stream)
    end.record(main)
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def format_measured(m: MeasuredHardware) -> str:
    """What ``mcore-offload measure`` prints: the machine, how it was timed, and the rates."""
    lines = [f"{m.name}, torch {m.torch_version}: {m.copy_mib} MiB pinned copies x{m.iters}, "
             f"bf16 GEMM {m.gemm_size}^3 x{m.iters}",
             f"  D2H {m.d2h_gbps:.1f} GB/s   H2D {m.h2d_gbps:.1f} GB/s   both directions {m.both_gbps:.1f} GB/s",
             f"  bf16 GEMM {m.dense_tflops:.0f} TFLOP/s   memory {m.memory_gib:.1f} GiB"]
    return "\n".join(lines) + "\n"
