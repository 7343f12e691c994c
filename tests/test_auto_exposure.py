"""How ``auto``'s probe reads the exposure (the share of host time that is step time): the forward's layer starts,
the backward's (logged; priced only with ``MCORE_OFFLOAD_AUTO_BACKWARD_EXPOSURE=1``), and under pipelining the
largest of the pipeline's ranks (``tests/test_auto_pipeline.py`` runs that one with two ranks)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from mcore_offload.runtime import auto as auto_module
from mcore_offload.runtime.auto import BACKWARD_EXPOSURE_VARIABLE, PROBE_STEPS, AutoPlanner, ChunkMarks
from tests.test_auto import _Mark

MiB = 2**20


def probe(caught_up: list[bool], backward: list[bool] | None = None) -> Any:
    """A planner through its probe steps. Its measured step's forward layer starts find the GPU caught up as
    ``caught_up`` says (after the first); ``backward``: the same for its backward's layer starts (None: not read)."""
    planner = AutoPlanner(None)
    for _ in range(PROBE_STEPS):
        if planner.measuring:
            marks = planner.chunk_started(0)
            planner._probe_t0 -= 1.0  # a 1 s step
            for done in [True, *caught_up]:
                marks.layer_started(_Mark(done))
            for layer in (1, 2, 3):
                planner.offloaded(0, 0, layer, "core_attn", 8 * MiB)
            if backward is not None:
                marks.bwd_checks, marks.bwd_caught_up = len(backward), sum(backward)
            planner.step_ended(lambda a, b: 1.0, 50.0, None, 0, runtime_ms=4.0)
        elif planner.tracing_peak:
            planner.step_ended(lambda a, b: 1.0, None, 900 * MiB, 16 * MiB, runtime_ms=4.0,
                               off_at_peak={(0, layer, "core_attn"): 8 * MiB for layer in (1, 2, 3)})
        else:
            planner.step_ended(lambda a, b: 1.0, None, None, 0)
    return planner.plan


def test_the_backward_checks_each_layer_once_against_the_layer_before(monkeypatch):
    """Groups of one layer share its mark; each new layer is checked against the previous layer's mark."""
    made: list[_Mark] = []

    def mark(device: Any) -> _Mark:
        made.append(_Mark(len(made) != 1))  # the second layer's mark is never reached
        return made[-1]

    monkeypatch.setattr(auto_module, "clock_mark", mark)
    marks = ChunkMarks(0)
    for layer in (4, 4, 3, 2, 2, 2, 1):  # backward runs the last layer first; a layer may have several groups
        marks.backward_group(layer, None)
    assert len(made) == 4 and (marks.bwd_checks, marks.bwd_caught_up) == (3, 2)
    cpu = ChunkMarks(0)
    monkeypatch.setattr(auto_module, "clock_mark", lambda device: 1.0)  # host clocks: nothing to compare with
    for layer in (2, 1):
        cpu.backward_group(layer, None)
    assert cpu.bwd_checks == 0


def test_the_backward_exposure_is_logged_and_priced_only_when_asked(monkeypatch, caplog):
    """The forward caught up at every layer start, the backward at none: by default the plan prices the forward's
    1.0; with the variable set, the mean 0.5."""
    with caplog.at_level(logging.INFO, logger="mcore_offload.runtime.auto"):
        plan = probe([True, True], backward=[False, False, False, False])
    assert plan.host.exposure == 1.0
    assert "backward layer starts where the GPU had caught up: 0 of 4 (0.00; forward 1.00)" in caplog.text
    assert "priced at their mean" not in caplog.text
    monkeypatch.setenv(BACKWARD_EXPOSURE_VARIABLE, "1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mcore_offload.runtime.auto"):
        plan = probe([True, True], backward=[False, False, False, False])
    assert plan.host.exposure == pytest.approx(0.5) and "priced at their mean" in caplog.text
    assert probe([True, True]).host.exposure == 1.0  # no backward read: the forward's alone
    monkeypatch.setenv(BACKWARD_EXPOSURE_VARIABLE, "yes")
    with pytest.raises(ValueError, match=f"{BACKWARD_EXPOSURE_VARIABLE}='yes' is not one of 0, 1"):
        AutoPlanner(None)


def test_without_a_pipeline_the_exposure_is_the_ranks_own():
    from mcore_offload.runtime.auto import largest_in_pipeline
    from tests.harness.gpt import init_parallel

    init_parallel()
    assert largest_in_pipeline(0.25) == 0.25 and largest_in_pipeline(None) is None
