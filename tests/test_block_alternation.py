"""--alternate-block B: blocks of plain and offloaded steps in one process (paired_steps.block_values), end to end on
the tiny CPU model and in overhead_ratio.py."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import overhead_ratio  # noqa: E402
from paired_steps import alternation_summary, block_on_steps, block_values  # noqa: E402
from test_benchmarks import tiny_pair  # noqa: E402


def test_blocks_start_plain_after_the_warm_up():
    # steps 1-2 are the block before the warm-up's end (offloaded), step 0 the plain one before that
    assert block_on_steps(13, 3, 2) == [False, True, True, False, False, True, True, False, False, True, True,
                                        False, False]
    assert block_on_steps(6, 0, 3) == [False, False, False, True, True, True]


def test_each_offloaded_block_is_set_against_its_plain_neighbours_without_their_first_steps():
    """Offloaded steps cost 10 %; every block's first step carries a switch's cost (×3) that must not count; a slow
    period (×1.3) covers the last blocks, where the ratio must still read 10 %."""
    on = block_on_steps(33, 3, 5)
    steps = []
    for i, o in enumerate(on):
        t = 100.0 * (1.1 if o else 1.0) * (1.3 if i >= 18 else 1.0)
        if i >= 3 and (i - 3) % 5 == 0:
            t *= 3  # the first step of a block
        steps.append(t)
    values = block_values(steps, on, first=3)
    # blocks from step 3: plain 3-7, on 8-12, plain 13-17, on 18-22, plain 23-27, on 28-32 (no plain after it)
    assert len(values) == 2 and values == pytest.approx([1.1, 1.1 * 1.3 / (0.5 * (1 + 1.3))])
    assert values[0] == pytest.approx(1.1)  # both neighbours in one regime: exact
    # blocks of two: a block's median is its mean, so a switch's cost counted in would move every value
    on2 = block_on_steps(11, 1, 2)
    steps2 = [(110.0 if o else 100.0) * (3 if i >= 1 and (i - 1) % 2 == 0 else 1) for i, o in enumerate(on2)]
    assert block_values(steps2, on2, first=1) == pytest.approx([1.1, 1.1])
    assert block_values(steps2, on2, first=1, skip=0) == pytest.approx([1.1, 1.1])  # the same factor on both sides
    steps2 = [t * (1.5 if o and (i - 1) % 2 == 0 else 1) for i, (t, o) in enumerate(zip(steps2, on2))]
    assert block_values(steps2, on2, first=1) == pytest.approx([1.1, 1.1])  # only the offloaded switch costs more
    assert block_values(steps2, on2, first=1, skip=0)[0] > 1.2
    summary = alternation_summary(steps, on, 3, block=5)
    assert summary["pairs"] == 2 and summary["block"] == 5 and "plain_steps" not in summary


def test_a_counted_stretch_starting_with_an_offloaded_block_skips_it():
    on = [True] * 2 + [False] * 2 + [True] * 2 + [False] * 2
    steps = [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 1.0, 1.0]
    assert block_values(steps, on, first=0) == [2.0]


def test_pretrain_gpt_alternate_block_keeps_the_loss_and_overhead_ratio_reads_it(tmp_path):
    common = ["--train-iters", "9", "--warmup-steps", "1"]
    base, ours = tiny_pair(tmp_path, 29641, common, [],
                           ["--fine-grained-activation-offloading", "--offload-modules", "core_attn",
                            "--alternate-offload", "--alternate-block", "2"])
    assert ours["loss_hex"] == base["loss_hex"]
    alt = ours["alternation"]
    assert alt["on_steps"] == block_on_steps(9, 1, 2) and alt["block"] == 2
    assert ours["offload"]["steps"] == sum(alt["on_steps"])
    assert alt["pairs"] == 1  # steps 3-4 offload between plain 1-2 and 5-6; 7-8's block has no plain one after it
    doc = {"args": {"warmup_steps": 1, "alternate_block": 2},
           "ranks": [{"rank": 0, "step_ms": ours["step_ms"], "alternation": alt}]}
    js = tmp_path / "ours.json"
    js.write_text(json.dumps(doc))
    (values,) = overhead_ratio.run_pairs(str(js)).values()
    counted = ours["step_ms"]
    assert values == pytest.approx([counted[4] / (0.5 * (counted[2] + counted[6]))])
    assert statistics.median(values) > 0


@pytest.mark.parametrize("flags", [["--alternate-block", "2"],
                                   ["--alternate-offload", "--alternate-block", "1"],
                                   ["--alternate-offload", "--alternate-period", "3", "--alternate-block", "2"]])
def test_alternate_block_refuses_what_it_cannot_do(flags):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"),
                           "--fine-grained-activation-offloading", "--offload-modules", "core_attn", *flags],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--alternate-block B alternates blocks" in proc.stderr
