"""Measure this machine's host link and GEMM rate, for ``mcore-offload plan --hardware-json``.

Why: the planner's presets are one H100's and one H200's measurements (GB200 is a spec sheet). On any other
machine, or to check a preset, ``mcore-offload measure --json-out hw.json`` times what the planner's overlap model
uses (``plan/hardware.py``): pinned device-to-host and host-to-device copies, both directions at once on two
streams, and a large bf16 GEMM; ``plan --hardware-json hw.json`` then plans with those rates and the device's memory.

Every rate is bytes (or FLOPs) over the CUDA-event time of ``iters`` back-to-back operations after two warm-up ones;
the host copies use pinned memory, as the runtime's pool does.

``--all-gpus`` times every visible GPU's copies at once, as every rank of a training job copies at once: GPUs that
share a PCIe switch, a root port or the host's memory bandwidth may each get less than one GPU alone. The file then
holds each rate's lowest over the GPUs, what every rank can count on, and every GPU's rates beside them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, replace
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
    #: GPUs whose copies were timed at once (``--all-gpus``); each link rate above is the lowest over them
    devices: int = 1
    #: each GPU's (D2H, H2D, both) GB/s when ``devices`` > 1, in device order
    per_device_gbps: tuple[tuple[float, float, float], ...] = ()

    def hardware(self) -> Hardware:
        """The planner's description of this machine."""
        together = f", {self.devices} GPUs copying at once, each rate the lowest" if self.devices > 1 else ""
        source = (f"measured on {self.name} by mcore-offload measure ({self.copy_mib} MiB pinned copies and a "
                  f"{self.gemm_size}^3 bf16 GEMM, x{self.iters}, torch {self.torch_version}{together})")
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
        # JSON has no tuples; the file's lists become the dataclass's tuples, so a loaded file equals its source
        per_device = tuple(tuple(rates) for rates in measured.per_device_gbps)
    except TypeError:
        raise PlanError(f"--hardware-json {path} lacks fields or has unknown ones; measure again with "
                        "'mcore-offload measure --json-out PATH'.") from None
    measured = replace(measured, per_device_gbps=per_device)
    rates = (measured.d2h_gbps, measured.h2d_gbps, measured.both_gbps, measured.dense_tflops, measured.memory_gib,
             *(r for each in per_device for r in each))
    if not all(isinstance(r, (int, float)) and r > 0 for r in rates):
        raise PlanError(f"--hardware-json {path} holds a rate that is not a positive number; measure again with "
                        "'mcore-offload measure --json-out PATH'.")
    n = measured.devices
    if not (isinstance(n, int) and n >= 1 and len(per_device) == (n if n > 1 else 0)):
        raise PlanError(f"--hardware-json {path} says devices {n!r} but holds per-GPU rates for {len(per_device)} "
                        "(none for one GPU); measure again with 'mcore-offload measure --json-out PATH'.")
    return measured


def measure(copy_mib: int = 256, iters: int = 20, gemm_size: int = 8192, device: int | None = None,
            all_gpus: bool = False) -> MeasuredHardware:
    """Time pinned D2H, H2D, both at once, and a bf16 GEMM on the current (or given) CUDA device; with
    ``all_gpus``, the copies on every visible device at once (the GEMM on the first)."""
    import torch

    if copy_mib < 1 or iters < 1 or gemm_size < 256:
        raise PlanError(f"--copy-mib and --iters must be at least 1 and --gemm-size at least 256, got {copy_mib}, "
                        f"{iters} and {gemm_size}; the defaults are 256, 20 and 8192.")
    if all_gpus and device is not None:
        raise PlanError("--all-gpus times every visible GPU at once and --device picks one of them; pass only one "
                        "(limit --all-gpus with CUDA_VISIBLE_DEVICES).")
    if not torch.cuda.is_available():
        raise PlanError("measuring needs a CUDA GPU and none is visible here; run it on the machine you plan for, "
                        "or describe that machine to plan with --gpu, --link-gbps and --tflops.")
    first = torch.cuda.current_device() if device is None else device
    devs = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if all_gpus else [
        torch.device("cuda", first)]
    dev = devs[0]
    name = torch.cuda.get_device_name(dev)
    logger.info("timing %d MiB pinned copies on %d GPU(s) at once and a %d^3 bf16 GEMM, x%d each, on %s",
                copy_mib, len(devs), gemm_size, iters, name)
    per_device = _link_rates(devs, copy_mib * MIB, iters)
    d2h, h2d, both = (min(rates[i] for rates in per_device) for i in range(3))
    with torch.cuda.device(dev):
        a, b = (torch.randn(gemm_size, gemm_size, dtype=torch.bfloat16, device=dev) for _ in range(2))
        gemm = (torch.cuda.current_stream(dev), lambda: torch.mm(a, b))
        tflops = 2 * gemm_size**3 * iters / _timed({dev: [gemm]}, iters)[dev] / 1e12
        memory = torch.cuda.get_device_properties(dev).total_memory / 2**30
    kept = tuple(tuple(round(r, 2) for r in rates) for rates in per_device) if len(devs) > 1 else ()
    return MeasuredHardware(name, round(d2h, 2), round(h2d, 2), round(both, 2), round(tflops, 1), round(memory, 1),
                            copy_mib, iters, gemm_size, torch.__version__, len(devs), kept)


def _link_rates(devs: list, nbytes: int, iters: int) -> list[tuple[float, float, float]]:
    """Per device, GB/s of pinned D2H, of H2D, and of both at once (each direction on its own stream, as in the
    runtime); every device in ``devs`` copies during the same windows."""
    import torch

    d2h, h2d = {}, {}
    for dev in devs:
        with torch.cuda.device(dev):
            out_dev, in_dev = (torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2))
            out_host, in_host = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2))
            # default arguments bind this device's buffers (a bare closure would see the last device's)
            d2h[dev] = (torch.cuda.Stream(dev), lambda o=out_host, i=out_dev: o.copy_(i, non_blocking=True))
            h2d[dev] = (torch.cuda.Stream(dev), lambda o=in_dev, i=in_host: o.copy_(i, non_blocking=True))
    out_s = _timed({dev: [d2h[dev]] for dev in devs}, iters)
    in_s = _timed({dev: [h2d[dev]] for dev in devs}, iters)
    both_s = _timed({dev: [d2h[dev], h2d[dev]] for dev in devs}, iters)
    return [(nbytes * iters / out_s[dev] / 1e9, nbytes * iters / in_s[dev] / 1e9,
             2 * nbytes * iters / both_s[dev] / 1e9) for dev in devs]


def _timed(work: dict, iters: int) -> dict:
    """Per device, seconds from a common start to the end of every stream's ``iters`` operations (``work`` maps a
    device to its (stream, op) pairs), after ``WARMUP`` untimed operations on each. All warm-ups end before any
    timing starts, so that no device's warm-up shares another's timed window."""
    import torch

    mains = {dev: torch.cuda.current_stream(dev) for dev in work}
    for dev, pairs in work.items():
        with torch.cuda.device(dev):
            for stream, op in pairs:
                stream.wait_stream(mains[dev])
                with torch.cuda.stream(stream):
                    for _ in range(WARMUP):
                        op()
    for dev in work:
        torch.cuda.synchronize(dev)
    events = {}
    for dev, pairs in work.items():
        with torch.cuda.device(dev):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(mains[dev])
            for stream, op in pairs:
                stream.wait_event(start)  # every stream starts at the same instant: "both" measures the overlap
                with torch.cuda.stream(stream):
                    for _ in range(iters):
                        op()
            events[dev] = (start, end)
    for dev, pairs in work.items():
        with torch.cuda.device(dev):
            for stream, _ in pairs:
                mains[dev].wait_stream(stream)
            events[dev][1].record(mains[dev])
    seconds = {}
    for dev, (start, end) in events.items():
        end.synchronize()
        seconds[dev] = start.elapsed_time(end) / 1e3
    return seconds


def format_measured(m: MeasuredHardware) -> str:
    """What ``mcore-offload measure`` prints: the machine, how it was timed, and the rates."""
    lines = [f"{m.name}, torch {m.torch_version}: {m.copy_mib} MiB pinned copies x{m.iters}, "
             f"bf16 GEMM {m.gemm_size}^3 x{m.iters}",
             f"  D2H {m.d2h_gbps:.1f} GB/s   H2D {m.h2d_gbps:.1f} GB/s   both directions {m.both_gbps:.1f} GB/s",
             f"  bf16 GEMM {m.dense_tflops:.0f} TFLOP/s   memory {m.memory_gib:.1f} GiB"]
    if m.devices > 1:
        lines[1] += f"   (each the lowest of {m.devices} GPUs copying at once)"
        lines += [f"  GPU {i}: D2H {d:.1f}   H2D {h:.1f}   both {b:.1f} GB/s"
                  for i, (d, h, b) in enumerate(m.per_device_gbps)]
    return "\n".join(lines) + "\n"
