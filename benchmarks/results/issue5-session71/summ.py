"""Per-rank summary of issue-5 benchmark JSONs (session 71): python3 summ.py runs/*/*.json.gz"""

import gzip
import json
import sys

GIB, MIB = 2**30, 2**20


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def rank_lines(r: dict) -> list[str]:
    alt, off = r.get("alternation") or {}, r.get("offload") or {}
    on = alt.get("on_steps") or []
    peaks = alt.get("step_peaks") or []
    on_peaks = [p for p, b in zip(peaks, on) if b]
    off_peaks = [p for p, b in zip(peaks, on) if not b]
    record = r.get("auto_record") or {}
    return [
        f" rank {r['rank']}: overhead {alt.get('paired_overhead_pct')} ci {alt.get('paired_overhead_ci95_pct')}"
        f" dpeak {alt.get('delta_peak_bytes', 0) / MIB:.0f} MiB"
        f" peak on max {max(on_peaks, default=float('nan')) / GIB:.3f}"
        f" off max {max(off_peaks, default=float('nan')) / GIB:.3f} GiB",
        f"   pinned/step {off.get('host_buffer_allocations_per_step')}"
        f"  on-demand/step {off.get('reloaded_on_demand_per_step')}  by_key {off.get('on_demand_by_key')}",
        f"   stall {r.get('stall_ms')} d2h {r.get('d2h_GBps')} h2d {r.get('h2d_GBps')}",
        f"   plan {json.dumps(record.get('plan'))[:600]}  need {record.get('need_bytes')}",
        f"   loss_hex[:3] {r['loss_hex'][:3]} n={len(r['loss_hex'])}",
    ]


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print("==", path)
        for rank in load(path)["ranks"]:
            print("\n".join(rank_lines(rank)))
