"""benchmarks/stack_sampler.py: the SIGPROF sampler puts each sample in the table of the step's kind, and the report
turns the per-kind counts into per-step milliseconds; pretrain_gpt.py --sample-stacks writes the tables."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from stack_sampler import StackSampler, report  # noqa: E402


def _spin_in_marker(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_samples_go_to_the_step_kind_and_name_the_busy_function():
    sampler = StackSampler(hz=1000, first_step=1)
    sampler.install()
    try:
        for on in [True, True, False, True, False]:
            sampler.start_step(on)
            if on:
                _spin_in_marker(0.12)
            else:
                time.sleep(0.05)  # no CPU: (almost) no samples
            sampler.end_step()
        _spin_in_marker(0.05)  # between steps: not sampled
    finally:
        sampler.uninstall()
    d = sampler.as_dict()
    assert d["on"]["steps"] == 2 and d["off"]["steps"] == 2  # step 0 is before first_step
    assert d["on"]["samples"] > 50
    assert d["off"]["samples"] < d["on"]["samples"] / 5
    marker = [k for k in d["on"]["inclusive"] if k.endswith(":_spin_in_marker")]
    assert marker and d["on"]["inclusive"][marker[0]] >= 0.8 * d["on"]["samples"]
    text = report(d)
    inclusive = text.split("inclusive")[1].split("self:")[0]
    assert "_spin_in_marker" in inclusive  # every frame of the spinning stack ties with it at the top


def test_report_gives_ms_a_step_from_counts():
    d = {"interval_s": 0.001, "first_step": 0,
         "on": {"steps": 2, "samples": 100, "inclusive": {"a.py:f": 60}, "self": {"a.py:f:3": 60}},
         "off": {"steps": 4, "samples": 80, "inclusive": {"a.py:f": 20}, "self": {}}}
    text = report(d)
    assert "on 50.0 ms, off 20.0 ms a step" in text
    assert "+25.00  (  30.00 /    5.00)  a.py:f" in text
    assert report({**d, "off": {**d["off"], "steps": 0}}).startswith("stack samples: no offloaded")


@pytest.mark.multiproc
def test_pretrain_gpt_writes_stack_samples(tmp_path):
    from test_benchmarks import tiny_run

    row = tiny_run(tmp_path / "s.json", 29641, ["--train-iters", "4", "--warmup-steps", "1",
                                                "--fine-grained-activation-offloading", "--offload-modules",
                                                "core_attn", "--alternate-offload", "--sample-stacks", "2000"])
    s = row["stack_samples"]
    assert s["on"]["steps"] == 1 and s["off"]["steps"] == 2  # steps 1 and 3 plain, step 2 offloaded
    assert s["on"]["samples"] + s["off"]["samples"] > 0
