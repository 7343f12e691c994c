"""``mcore-offload measure`` and ``plan --hardware-json``: the measured machine reaches the planner whole, bad input
is one sentence. (The timing itself needs a GPU:
tests/test_gpu.py::test_measure_times_the_link_and_the_gemm_and_plan_takes_the_file.)"""

from __future__ import annotations

import json
import re

import pytest
import torch

from mcore_offload.cli import build_parser, main
from mcore_offload.plan import build_plan
from mcore_offload.plan.cli import config_from_args
from mcore_offload.plan.measure import FORMAT, MeasuredHardware, format_measured, load_measured

PLAN = ["plan", "--preset", "llama3-8b", "--seq-length", "8192", "--num-microbatches", "4"]


def measured(**kw) -> MeasuredHardware:
    fields = dict(name="Test GPU 96GB", d2h_gbps=25.0, h2d_gbps=24.0, both_gbps=40.0, dense_tflops=400.0,
                  memory_gib=94.5, copy_mib=256, iters=20, gemm_size=8192, torch_version="2.13.0")
    return MeasuredHardware(**{**fields, **kw})


def write(tmp_path, doc, name="hw.json"):
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def config_of(argv):
    return config_from_args(build_parser().parse_args(argv))[0]


def test_the_measured_rates_and_memory_are_the_plans_hardware(tmp_path, capsys):
    path = write(tmp_path, measured().to_json())
    hw = config_of([*PLAN, "--hardware-json", path]).hardware
    assert (hw.link.d2h_gbps, hw.link.h2d_gbps, hw.link.both_gbps, hw.dense_tflops, hw.memory_gib) == (
        25.0, 24.0, 40.0, 400.0, 94.5)
    assert hw.name == "Test GPU 96GB" and hw.source.startswith("measured on Test GPU 96GB by mcore-offload measure")
    assert main([*PLAN, "--hardware-json", path]) == 0
    assert "measured on Test GPU 96GB" in capsys.readouterr().out
    assert load_measured(path) == measured()


def test_a_slower_measured_link_makes_the_plan_move_fewer_bytes(tmp_path):
    """The rates are not just printed: the recommendation follows them (the same machine at a tenth of the
    link offloads less under the same exposure limit)."""
    fast = build_plan(config_of([*PLAN, "--hardware-json", write(tmp_path, measured().to_json(), "fast.json")]))
    slow_hw = measured(d2h_gbps=2.5, h2d_gbps=2.4, both_gbps=4.0).to_json()
    slow = build_plan(config_of([*PLAN, "--hardware-json", write(tmp_path, slow_hw, "slow.json")]))
    assert sum(slow.recommendation.freed_bytes) < sum(fast.recommendation.freed_bytes)


def test_plan_flags_still_override_the_measured_file(tmp_path):
    path = write(tmp_path, measured().to_json())
    hw = config_of([*PLAN, "--hardware-json", path, "--tflops", "100", "--link-both-gbps", "30"]).hardware
    assert (hw.dense_tflops, hw.link.both_gbps, hw.link.d2h_gbps) == (100.0, 30.0, 25.0)
    assert "100 TFLOP/s (override)" in hw.source and "both directions 30 GB/s (override)" in hw.source


def test_without_a_file_the_default_gpu_is_still_h100():
    assert config_of(PLAN).hardware.name == "h100"


@pytest.mark.parametrize(("doc", "extra", "message"), [
    (None, [], r"cannot read --hardware-json .*missing\.json .*'mcore-offload measure --json-out PATH'"),
    ("{not json", [], r"is not JSON; write one with"),
    ({"format": "something else", "d2h_gbps": 1}, [], r"was not written by 'mcore-offload measure'"),
    ({"format": FORMAT, "d2h_gbps": 1.0}, [], r"lacks fields or has unknown ones"),
    ({**measured().to_json(), "both_gbps": -4.0}, [], r"holds a rate that is not a positive number"),
    ({**measured().to_json(), "memory_gib": "94"}, [], r"holds a rate that is not a positive number"),
    ({**measured().to_json(), "devices": 2, "per_device_gbps": [[25.0, 24.0, 40.0], [0.0, 24.0, 40.0]]}, [],
     r"holds a rate that is not a positive number"),
    ({**measured().to_json(), "devices": 3, "per_device_gbps": [[25.0, 24.0, 40.0]]}, [],
     r"says devices 3 but holds per-GPU rates for 1 \(none for one GPU\)"),
    (measured().to_json(), ["--gpu", "h200"], r"pass either --gpu h200 or --hardware-json, not both"),
], ids=["missing", "not-json", "foreign", "fields", "negative", "string", "per-device", "gpu-count", "with-gpu"])
def test_a_bad_hardware_file_is_one_clear_sentence(tmp_path, capsys, doc, extra, message):
    path = str(tmp_path / "missing.json") if doc is None else write(tmp_path, doc)
    assert main([*PLAN, "--hardware-json", path, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mcore-offload plan: ") and "\n" not in err and err.endswith(".")
    assert re.search(message, err), err


def test_measure_refuses_bad_sizes_before_looking_for_a_gpu(capsys):
    assert main(["measure", "--iters", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mcore-offload measure: --copy-mib and --iters must be at least 1") and "\n" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the sentence for machines without a GPU")
def test_measure_without_a_gpu_says_what_to_do_instead(tmp_path, capsys):
    out = tmp_path / "hw.json"
    assert main(["measure", "--json-out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("mcore-offload measure: measuring needs a CUDA GPU and none is visible here; run it on the "
                   "machine you plan for, or describe that machine to plan with --gpu, --link-gbps and --tflops.")
    assert not out.exists()


def test_measure_refuses_all_gpus_with_one_device_before_looking_for_a_gpu(capsys):
    assert main(["measure", "--all-gpus", "--device", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("mcore-offload measure: --all-gpus times every visible GPU at once and --device picks one of "
                   "them; pass only one (limit --all-gpus with CUDA_VISIBLE_DEVICES).")


def test_a_file_of_gpus_copying_at_once_plans_with_the_lowest_rates_and_keeps_each(tmp_path, capsys):
    """``measure --all-gpus``: each of the file's link rates is the lowest over the GPUs (what every rank can count
    on when all copy at once), each GPU's rates travel beside them, and the plan says how they were measured."""
    m = measured(d2h_gbps=20.0, devices=2, per_device_gbps=((25.0, 24.0, 40.0), (20.0, 24.0, 41.0)))
    path = write(tmp_path, m.to_json())
    assert load_measured(path) == m
    hw = config_of([*PLAN, "--hardware-json", path]).hardware
    assert hw.link.d2h_gbps == 20.0 and "2 GPUs copying at once, each rate the lowest" in hw.source
    text = format_measured(m)
    assert "(each the lowest of 2 GPUs copying at once)" in text
    assert "GPU 1: D2H 20.0   H2D 24.0   both 41.0 GB/s" in text


def test_a_file_from_before_all_gpus_still_loads_as_one_gpu(tmp_path):
    """Files written before ``--all-gpus`` existed lack its two fields; they are one GPU's measurements."""
    doc = {k: v for k, v in measured().to_json().items() if k not in ("devices", "per_device_gbps")}
    m = load_measured(write(tmp_path, doc))
    assert m == measured() and m.devices == 1 and m.per_device_gbps == ()
    assert "at once" not in format_measured(m) and "at once" not in m.hardware().source
