"""Session 44's tables from the committed perf_steps.py summaries (runs/*.perf.json.gz): python3 summarize.py"""

import collections
import gzip
import json
from pathlib import Path

RUNS = Path(__file__).with_name("runs")
FILES = ["pf1-alt_attn", "pf2-alt_attn", "pf3-alt_attn", "pf2-alt_attn_hooks", "pf1-dmaload"]
KEYS = ["thread main", "thread pt_autograd_N", "ours main", "ours pt_autograd_N",
        "selflib main python3.12", "selflib pt_autograd_N python3.12",
        "selflib main libcuda.so.580.159.04", "selflib pt_autograd_N libcuda.so.580.159.04"]


def rows(name: str, rank: str) -> dict:
    data = json.loads(gzip.decompress((RUNS / f"{name}-none-1.perf.json.gz").read_bytes()))
    return {r["key"]: r for r in data["ranks"][rank]["rows"]}


for rank in ("0", "1"):
    print(f"rank {rank}: offloaded minus plain steps, CPU ms a step (± standard error)")
    print(f"  {'key':<44}" + "".join(f"{f:>21}" for f in FILES))
    tables = {f: rows(f, rank) for f in FILES}
    for key in KEYS:
        cells = [f"{t[key]['diff_ms']:+8.2f} ± {t[key]['se_ms']:4.2f}" if key in t else f"{'-':>15}"
                 for t in tables.values()]
        print(f"  {key:<44}" + "".join(f"{c:>21}" for c in cells))
    # pf3 only (its perf_steps.py had the under-ours keys): where the time under our module goes, by library
    under = collections.Counter()
    for key, r in rows("pf3-alt_attn", rank).items():
        if key.startswith("under-ours "):
            _, thread, rest = key.split(" ", 2)
            under[(thread, rest.split(":", 1)[0])] += r["on_ms"]
    print("  pf3, under our C++ module (offloaded steps), ms a step by thread and library:")
    for (thread, lib), ms in under.most_common(8):
        print(f"    {thread:<15}{lib:<45}{ms:6.2f}")
    print()
