"""One rank's row of a ``pretrain_gpt.py`` result JSON, for the tools that read its per-step values
(``step_floor.py``, ``host_periods.py``).

Why one loader: both pick a rank and count steps from the run's own warm-up; two copies of that had drifted apart
(different error sentences, and a warm-up of 0 in one and 5 in the other where a JSON lacked it). Every JSON that
``pretrain_gpt.py`` writes records its ``args.warmup_steps``, so a JSON without one is refused rather than guessed.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_row(path: str, rank: int) -> tuple[dict, dict]:
    """The run's ``args`` and its row for ``rank``; a missing rank or warm-up is one clear sentence (SystemExit)."""
    data = json.loads(Path(path).read_text())
    ranks = [r.get("rank") for r in data.get("ranks", [])]
    if rank not in ranks:
        raise SystemExit(f"{path} has no rank {rank}: pass --rank with one of {ranks}")
    args = data.get("args") or {}
    if not isinstance(args.get("warmup_steps"), int):
        raise SystemExit(f"{path} has no args.warmup_steps: it is not a pretrain_gpt.py result JSON; pass one that "
                         "pretrain_gpt.py --json-out wrote")
    return args, data["ranks"][ranks.index(rank)]
