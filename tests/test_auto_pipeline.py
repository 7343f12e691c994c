"""``auto`` under pipeline parallelism (CPU, gloo, two processes): the exposure a plan uses is the largest its
pipeline's ranks measured (``runtime/auto.py``'s ``largest_in_pipeline``; session 68: a rank whose GPU waits for its
neighbour reads a host that is ahead, and its plan then cost +6.3 % of the step)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.gpt import init_parallel
from tests.harness.multiproc import run_multiprocess

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
MiB = 2**20


class _Mark:
    """A clock mark the device had (``done``) or had not yet reached."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def _probe(caught_up: list[bool]) -> Any:
    """A planner through its probe steps, its measured step's layer starts caught up as ``caught_up`` says."""
    from mcore_offload.runtime.auto import PROBE_STEPS, AutoPlanner

    planner = AutoPlanner(None)
    for _ in range(PROBE_STEPS):
        if planner.measuring:
            planner.chunk_started(0)
            planner._probe_t0 -= 1.0  # a 1 s step
            for done in [True, *caught_up]:
                planner._marks[-1].layer_started(_Mark(done))
            for layer in (1, 2, 3):
                planner.offloaded(0, 0, layer, "core_attn", 8 * MiB)
            planner.step_ended(lambda a, b: 1.0, 50.0, None, 0, runtime_ms=4.0)
        elif planner.tracing_peak:
            planner.step_ended(lambda a, b: 1.0, None, 900 * MiB, 16 * MiB, runtime_ms=4.0,
                               off_at_peak={(0, layer, "core_attn"): 8 * MiB for layer in (1, 2, 3)})
        else:
            planner.step_ended(lambda a, b: 1.0, None, None, 0)
    return planner.plan


def pipeline_job(rank: int, world_size: int) -> dict[str, Any]:
    from mcore_offload.runtime.auto import largest_in_pipeline

    init_parallel(world_size, rank, pp=2)
    # rank 0's GPU caught up at every layer start, rank 1's never (it waits for rank 0, not for its host)
    plan = _probe([True, True, True] if rank == 0 else [False, False, False])
    return {"largest": largest_in_pipeline([0.25, 0.5][rank]), "none": largest_in_pipeline(None),
            "mixed": largest_in_pipeline(None if rank == 0 else 0.1), "exposure": plan.host.exposure}


def test_a_plan_under_pipelining_uses_the_largest_exposure_of_its_pipeline():
    results = run_multiprocess(pipeline_job, 2, timeout_s=240)
    for r in results:
        assert r["largest"] == 0.5 and r["none"] is None and r["mixed"] == 0.1
        assert r["exposure"] == 1.0  # rank 1 measured 0.0 and plans with rank 0's 1.0


def test_without_a_pipeline_the_exposure_is_the_ranks_own():
    from mcore_offload.runtime.auto import largest_in_pipeline

    init_parallel()
    assert largest_in_pipeline(0.25) == 0.25 and largest_in_pipeline(None) is None
