"""Session 58: one line per run of bound.sh's folder: the peak of step 1, what the allocator reserved, its
synchronisations a step, the step time (median after the warm-up), the runtime's stall a step, the waits the copy-out
bound made, and whether the loss equals the no-offload run's (the run labelled F4).

    python3 benchmarks/results/d2h-in-flight-session58/summarize.py DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MIB = 2**20


def main(folder: Path) -> None:
    runs = {p.stem: json.loads(p.read_text())["ranks"][0] for p in sorted(folder.glob("*.json"))}
    plain = runs.get("F4")
    print("run: peak MiB (Δ vs F4), reserved MiB, allocator syncs a step, step ms (median), stall ms a step, "
          "bound waits, off-device at peak MiB, loss equal to F4")
    for label, r in runs.items():
        peak = r["peak_bytes_step1"] / MIB
        delta = f" (Δ {plain['peak_bytes_step1'] / MIB - peak:.1f})" if plain and label != "F4" else ""
        off = r.get("offload") or {}
        stall = [s for s in (off.get("per_step") or {}).get("stall_ms", []) if s is not None]
        print(f"{label}: peak {peak:.1f}{delta}, reserved "
              f"{r['allocator_state']['reserved_bytes.all.current'] / MIB:.0f}, syncs "
              f"{r['allocator_per_step']['num_sync_all_streams']}, step {r['step_ms_median']:.1f}, stall "
              f"{[round(s, 1) for s in stall]}, waits {off.get('d2h_in_flight_waits', '-')}, off at peak "
              f"{(off.get('off_device_at_peak_bytes') or 0) / MIB:.0f}, loss equal "
              f"{plain is not None and r['loss_hex'] == plain['loss_hex']}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
