"""``auto`` under pipeline parallelism (CPU, gloo, two processes): the exposure a plan uses is the largest its
pipeline's ranks measured (``runtime/auto.py``'s ``largest_in_pipeline``; session 68: a rank whose GPU waits for its
neighbour reads a host that is ahead, and its plan then cost +6.3 % of the step)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.gpt import init_parallel
from tests.harness.multiproc import run_multiprocess
from tests.test_auto_exposure import probe

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


def pipeline_job(rank: int, world_size: int) -> dict[str, Any]:
    from mcore_offload.runtime.auto import largest_in_pipeline

    init_parallel(world_size, rank, pp=2)
    # rank 0's GPU caught up at every layer start, rank 1's never (it waits for rank 0, not for its host)
    plan = probe([True, True, True] if rank == 0 else [False, False, False])
    return {"largest": largest_in_pipeline([0.25, 0.5][rank]), "none": largest_in_pipeline(None),
            "mixed": largest_in_pipeline(None if rank == 0 else 0.1), "exposure": plan.host.exposure}


def test_a_plan_under_pipelining_uses_the_largest_exposure_of_its_pipeline():
    results = run_multiprocess(pipeline_job, 2, timeout_s=240)
    for r in results:
        assert r["largest"] == 0.5 and r["none"] is None and r["mixed"] == 0.1
        assert r["exposure"] == 1.0  # rank 1 measured 0.0 and plans with rank 0's 1.0

