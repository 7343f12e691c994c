"""Compare pretrain_gpt.py JSON results against their baseline: bitwise loss equality and peak memory.

    python benchmarks/gpu/compare_runs.py OUTDIR  # files NAME__baseline.json and NAME__<variant>.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(outdir: str) -> int:
    out = Path(outdir)
    rows, failures = [], 0
    for base_file in sorted(out.glob("*__baseline.json")):
        model = base_file.name.split("__")[0]
        base = json.loads(base_file.read_text())["ranks"]
        for var_file in sorted(out.glob(f"{model}__*.json")):
            if var_file == base_file:
                continue
            var = json.loads(var_file.read_text())["ranks"]
            for b, v in zip(base, var):
                equal = b["loss_hex"] == v["loss_hex"]
                lower = v["peak_bytes"] < b["peak_bytes"]
                off = v.get("offload", {}).get("last_step", {})
                offl = sum(c["offloaded"] for c in off.values())
                rel = sum(c["released_in_forward"] for c in off.values())
                ok = equal and (lower or offl == 0)
                failures += not ok
                rows.append((model, var_file.stem.split("__")[1], b["rank"], equal,
                             b["peak_bytes"] / 2**20, v["peak_bytes"] / 2**20,
                             (b["peak_bytes"] - v["peak_bytes"]) / 2**20, offl / 2**20, rel / 2**20,
                             b["step_ms_median"], v["step_ms_median"], "ok" if ok else "FAIL"))
    hdr = ("model", "variant", "rank", "loss_equal", "base_peak_MiB", "peak_MiB", "dpeak_MiB",
           "offloaded_MiB", "released_fwd_MiB", "base_ms", "ms", "verdict")
    print(" | ".join(hdr))
    for r in rows:
        print(" | ".join(f"{x:.1f}" if isinstance(x, float) else str(x) for x in r))
    print(f"{len(rows) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
