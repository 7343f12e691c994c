"""Per rank, how many loss steps of each run are bitwise equal to a reference run's (session 72).

python3 losscmp.py REF.json.gz RUN.json.gz [RUN.json.gz ...]
"""

import gzip
import json
import sys


def losses_by_rank(path: str) -> dict:
    with gzip.open(path, "rt") as f:
        return {r["rank"]: r.get("loss_hex") for r in json.load(f)["ranks"]}


if __name__ == "__main__":
    ref = losses_by_rank(sys.argv[1])
    for path in sys.argv[2:]:
        run = losses_by_rank(path)
        for rank, a in ref.items():
            b = run.get(rank)
            if not a or not b or a[0] is None:
                continue  # a rank that computes no loss (not the last pipeline stage)
            n = min(len(a), len(b))
            equal = sum(x == y for x, y in zip(a[:n], b[:n]))
            print(path.split("results/")[-1], "rank", rank, "equal", equal, "of", n)
