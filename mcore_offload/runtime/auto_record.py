"""What ``auto`` chose its plan from, as plain JSON, and back.

Why: a plan is chosen once per rank, on the GPU, from the probe's measurements (bytes per unit, the host-time model,
the link rate, the target) and the traced plain step (runtime/peak_trace.py). Kept in the benchmark JSON, these
inputs let the choice be replayed and compared offline (``benchmarks/auto_replay.py``): which share of the full set's
saving fits under the host budget, and what another budget or rule would pick, without device time.

Keys become lists: a chunk (``vp_stage``, an int or None) and a layer stay as they are, a unit (a tuple of point
names) becomes a list.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from mcore_offload.runtime.auto_choice import ChunkProfile, HostCost, Plan
from mcore_offload.runtime.peak_trace import PeakTrace

RECORD_VERSION = 1


def _profile(p: ChunkProfile) -> dict[str, Any]:
    return {
        "layer_ms": [[layer, ms] for layer, ms in sorted(p.layer_ms.items())],
        "tail_ms": p.tail_ms,
        "unit_bytes": [[layer, list(unit), n] for (layer, unit), n in sorted(p.unit_bytes.items())],
        "live_at_peak": p.live_at_peak,
        "kept": [[layer, list(unit)] for layer, unit in sorted(p.kept)],
        "peak_bytes": None if p.peak_bytes is None else
        [[layer, list(unit), n] for (layer, unit), n in sorted(p.peak_bytes.items())],
    }


def _unprofile(d: dict[str, Any]) -> ChunkProfile:
    return ChunkProfile(
        layer_ms={layer: ms for layer, ms in d["layer_ms"]},
        tail_ms=d["tail_ms"],
        unit_bytes={(layer, tuple(unit)): n for layer, unit, n in d["unit_bytes"]},
        live_at_peak=d["live_at_peak"],
        kept={(layer, tuple(unit)) for layer, unit in d["kept"]},
        peak_bytes=None if d["peak_bytes"] is None else
        {(layer, tuple(unit)): n for layer, unit, n in d["peak_bytes"]},
    )


def to_record(profiles: dict[Any, ChunkProfile], host: HostCost | None, link_GBps: float, need_bytes: int | None,
              trace: PeakTrace | None, plan: Plan) -> dict[str, Any]:
    """The inputs of one :func:`~mcore_offload.runtime.auto_choice.choose` call and its plan, JSON-ready. The trace
    is keyed by (chunk, layer, unit) as the choice saw it."""
    host_d = None
    if host is not None:
        host_d = asdict(host)
        host_d["microbatches"] = [[vp, n] for vp, n in host.microbatches.items()]
    return {
        "version": RECORD_VERSION,
        "profiles": [[vp, _profile(p)] for vp, p in profiles.items()],
        "host": host_d,
        "link_GBps": link_GBps,
        "need_bytes": need_bytes,
        "trace": None if trace is None else {
            "plain": list(trace.plain), "floor": trace.floor,
            "off": [[[k[0], k[1], list(k[2]), n] for k, n in off.items()] for off in trace.off]},
        "plan": {"points": [[vp, layer, sorted(pts)] for (vp, layer), pts in plan.points.items()],
                 "expected_saving_bytes": plan.expected_saving_bytes, "host_ms": plan.host_ms,
                 "hidden": plan.hidden, "describe": plan.describe()},
    }


def from_record(rec: dict[str, Any]) -> tuple[dict[Any, ChunkProfile], HostCost | None, float, int | None,
                                              PeakTrace | None]:
    """``(profiles, host, link_GBps, need_bytes, trace)`` for :func:`choose`, from :func:`to_record`'s output."""
    if rec.get("version") != RECORD_VERSION:
        raise ValueError(f"auto record version {rec.get('version')!r} is not {RECORD_VERSION}: replay it with the "
                         "mcore-offload release that wrote it")
    host = None
    if rec["host"] is not None:
        h = dict(rec["host"])
        h["microbatches"] = {vp: n for vp, n in h["microbatches"]}
        host = HostCost(**h)
    trace = None
    if rec["trace"] is not None:
        t = rec["trace"]
        trace = PeakTrace(list(t["plain"]), [{(vp, layer, tuple(unit)): n for vp, layer, unit, n in off}
                                             for off in t["off"]], t["floor"])
    profiles = {vp: _unprofile(p) for vp, p in rec["profiles"]}
    return profiles, host, rec["link_GBps"], rec["need_bytes"], trace
