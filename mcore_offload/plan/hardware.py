"""GPU and host-link presets, a layer's forward compute time, and how much of a transfer stays exposed.

Overlap model (per layer, per microbatch, ``F`` = the layer's forward time, ``B`` = bytes offloaded):

* forward: the D2H copy of layer ``i``'s groups runs under layer ``i + 1``'s forward: exposed
  ``max(0, B / D2H - F)``;
* backward: the H2D reload runs under the following layer's backward (about ``2F``): exposed
  ``max(0, B / H2D - 2F)``;
* 1F1B steady state, both directions at once on the shared link: exposed ``max(0, 2B / BOTH - 3F)``.

The exposed time is the larger of (forward + backward) and (steady state), as a fraction of the layer's
compute ``3F``. ``F`` uses the dense GEMM rate for every FLOP (attention, norms and communication run
slower), so compute time is underestimated and the exposure check errs on the safe side.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, replace

from mcore_offload.plan.activations import routed_rows
from mcore_offload.plan.model import ModelSpec, ParallelLayout, PlanError, TrainingSpec

BACKWARD_FACTOR = 2.0


@dataclass(frozen=True)
class LinkSpeed:
    """Pinned host memory <-> GPU, in GB/s (1e9 bytes per second)."""

    d2h_gbps: float
    h2d_gbps: float
    both_gbps: float  # total when both directions run at once


@dataclass(frozen=True)
class Hardware:
    name: str
    dense_tflops: float  # bf16/fp16 dense GEMM rate used for compute time
    link: LinkSpeed
    memory_gib: float
    source: str


_GPUS: Mapping[str, Hardware] = types.MappingProxyType({
    # Measured on an H100 SXM 80GB (PCIe Gen5 x16 host link): pinned copies and a large bf16 GEMM.
    "h100": Hardware("h100", 789.0, LinkSpeed(54.9, 54.5, 86.0), 79.6,
                     "H100 SXM, measured: pinned D2H 54.9, H2D 54.5, both 86 GB/s; bf16 GEMM 789 TFLOP/s"),
    # Measured on GPU 0 of a 2x H200 host (PCIe Gen5 x16) with `mcore-offload measure`, session 62
    # (benchmarks/results/measure-h200-session62). Both directions together run faster than on the H100 host
    # (101 against 86 GB/s); each direction and the GEMM match it. Memory as nvidia-smi reports it, as for h100.
    "h200": Hardware("h200", 790.0, LinkSpeed(55.3, 55.5, 101.0), 140.4,
                     "H200, measured: pinned D2H 55.3, H2D 55.5, both 101 GB/s; bf16 GEMM 790 TFLOP/s"),
    # Spec sheet only, not measured: NVLink-C2C to Grace memory, dense bf16 per Blackwell GPU, 186 GB HBM3e.
    "gb200": Hardware("gb200", 2500.0, LinkSpeed(450.0, 450.0, 900.0), 173.2,
                      "GB200, spec sheet: NVLink-C2C 450 GB/s each way, 900 both; 2.5 PFLOP/s dense bf16"),
})


def gpu_names() -> tuple[str, ...]:
    return tuple(_GPUS)


def get_hardware(name: str, link_gbps: float | None = None, link_both_gbps: float | None = None,
             tflops: float | None = None) -> Hardware:
    """Preset ``name`` with optional overrides. ``link_gbps`` sets both directions; without
    ``link_both_gbps`` the preset's ratio of simultaneous to single-direction bandwidth is kept."""
    try:
        hw = _GPUS[name]
    except KeyError:
        raise PlanError(f"Unknown GPU {name!r}: choose one of {', '.join(_GPUS)} "
                        "(use --link-gbps / --tflops to describe another, or measure it with "
                        "'mcore-offload measure').") from None
    return with_link_overrides(hw, link_gbps, link_both_gbps, tflops)


def with_link_overrides(hw: Hardware, link_gbps: float | None = None, link_both_gbps: float | None = None,
                        tflops: float | None = None) -> Hardware:
    """``hw`` with plan's --link-gbps / --link-both-gbps / --tflops applied, each noted in its source."""
    for flag, value in (("--link-gbps", link_gbps), ("--link-both-gbps", link_both_gbps), ("--tflops", tflops)):
        if value is not None and not value > 0:
            raise PlanError(f"{flag} must be a positive number, got {value!r}; pass a rate above 0.")
    link = hw.link
    notes = []
    if link_gbps is not None:
        ratio = link.both_gbps / (link.d2h_gbps + link.h2d_gbps)
        link = LinkSpeed(link_gbps, link_gbps, 2 * link_gbps * ratio)
        notes.append(f"link {link_gbps:g} GB/s each way (override)")
    if link_both_gbps is not None:
        link = replace(link, both_gbps=link_both_gbps)
        notes.append(f"both directions {link_both_gbps:g} GB/s (override)")
    if tflops is not None:
        hw = replace(hw, dense_tflops=tflops)
        notes.append(f"{tflops:g} TFLOP/s (override)")
    if notes:
        hw = replace(hw, link=link, source=f"{hw.source}; " + "; ".join(notes))
    return hw


def layer_forward_flops(model: ModelSpec, layout: ParallelLayout, training: TrainingSpec, moe: bool) -> float:
    """Forward FLOPs of one layer and one microbatch on one rank (matrix multiplies only, causal attention)."""
    t = layout.tp
    s, tokens = training.seq_length, training.seq_length * training.micro_batch_size
    h, q, kv = model.hidden_size, model.q_dim, model.kv_dim
    flops = 2 * tokens * h * (q + 2 * kv) / t  # QKV projection
    flops += 2 * tokens * s * q / t  # QK^T and PV, halved by the causal mask
    flops += 2 * tokens * q * h / t  # output projection
    mats = 3 if model.swiglu else 2
    if not moe:
        return flops + 2 * tokens * h * model.ffn_hidden_size * mats / t
    rows = routed_rows(model, layout, training)
    flops += 2 * rows * h * model.moe_ffn * mats / layout.etp
    flops += 2 * tokens * h * (model.num_experts or 0) / layout.seq_shards  # router
    if model.moe_shared_expert_intermediate_size:
        flops += 2 * tokens * h * model.moe_shared_expert_intermediate_size * mats / t
    return flops


def forward_seconds(flops: float, hw: Hardware, dtype: str) -> float:
    # fp32 parameters run on TF32 tensor cores at half the bf16 rate.
    rate = hw.dense_tflops * (0.5 if dtype == "fp32" else 1.0) * 1e12
    return flops / rate


@dataclass(frozen=True)
class TransferTiming:
    nbytes: int
    forward_s: float
    d2h_s: float
    h2d_s: float
    both_s: float
    exposed_s: float
    backward_factor: float = BACKWARD_FACTOR

    @property
    def compute_s(self) -> float:
        return self.forward_s * (1 + self.backward_factor)

    @property
    def exposed_fraction(self) -> float:
        return self.exposed_s / self.compute_s if self.compute_s > 0 else (1.0 if self.nbytes else 0.0)


def transfer_timing(nbytes: int, forward_s: float, link: LinkSpeed,
                    backward_factor: float = BACKWARD_FACTOR) -> TransferTiming:
    """Copy times of ``nbytes`` each way and the part no compute hides (see the module docstring)."""
    d2h = nbytes / (link.d2h_gbps * 1e9)
    h2d = nbytes / (link.h2d_gbps * 1e9)
    both = 2 * nbytes / (link.both_gbps * 1e9)
    one_way = max(0.0, d2h - forward_s) + max(0.0, h2d - backward_factor * forward_s)
    steady = max(0.0, both - (1 + backward_factor) * forward_s)
    return TransferTiming(nbytes, forward_s, d2h, h2d, both, max(one_way, steady), backward_factor)
