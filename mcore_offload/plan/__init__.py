"""Plan an offloaded run before launching it: per pipeline rank, activation bytes per offload point, the
microbatches in flight at the peak, the projected peak for each offload set, transfer time against compute,
and a recommended ``offload_modules``. CPU only, no torch or megatron import. See docs/plan.md.

Library use (config plus function)::

    from mcore_offload.plan import ParallelLayout, PlanConfig, TrainingSpec, build_plan, get_hardware, get_preset

    plan = build_plan(PlanConfig(get_preset("llama3-8b"), ParallelLayout(pipeline_model_parallel_size=4),
                                 TrainingSpec(num_microbatches=16, dtype="bf16"), get_hardware("h100")))
    plan.recommendation.modules  # ('qkv_linear', 'core_attn')
    plan.delta_peak(("core_attn",))  # per rank, how much a set lowers the projected peak (bytes)
    plan.offloaded_per_step(("core_attn",))  # per rank and point, bytes copied to the host in one step
"""

from __future__ import annotations

from mcore_offload.plan.activations import LayerActivations, PointEstimate, Storage, layer_activations
from mcore_offload.plan.hardware import Hardware, LinkSpeed, TransferTiming, get_hardware, transfer_timing
from mcore_offload.plan.model import ModelSpec, ParallelLayout, PlanError, TrainingSpec, get_preset
from mcore_offload.plan.peak import Instant, RankTimeline
from mcore_offload.plan.planner import OffloadSet, Plan, PlanConfig, RankPlan, build_plan
from mcore_offload.plan.recommend import LayerCost, RankDemand, Recommendation, recommend
from mcore_offload.plan.schedule import (
    in_flight_forwards,
    kept_forwards,
    peak_layers,
    pipeline_order,
    warmup_forwards,
)
from mcore_offload.plan.validate import validate

__all__ = [
    "Hardware",
    "Instant",
    "LayerActivations",
    "LayerCost",
    "LinkSpeed",
    "ModelSpec",
    "OffloadSet",
    "ParallelLayout",
    "Plan",
    "PlanConfig",
    "PlanError",
    "PointEstimate",
    "RankDemand",
    "RankPlan",
    "RankTimeline",
    "Recommendation",
    "Storage",
    "TrainingSpec",
    "TransferTiming",
    "build_plan",
    "get_preset",
    "get_hardware",
    "in_flight_forwards",
    "kept_forwards",
    "layer_activations",
    "peak_layers",
    "pipeline_order",
    "recommend",
    "transfer_timing",
    "validate",
    "warmup_forwards",
]
