"""A group's backward in C++ (``runtime/native/backward.cpp``: commit_backward, group_done; ``finish_release.cpp``)
against the handler's Python methods: training steps on the logging stub CUDA runtime
(``benchmarks/cpu_transport_glue.py``) make the same CUDA calls in the same order, count the same bytes, hand the same
buffers back to the pool and compute the same losses and gradients, bit for bit, under each prefetch mode and burst
setting; and the C++ functions step aside (answer False, having changed nothing) where the Python methods must decide:
each chunk's first group, bursts of several layers."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_raw_transport_stub import _train as train_toy

from mcore_offload.runtime import manager as manager_module
from mcore_offload.runtime import native as native_module
from mcore_offload.summary import get_summary

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cpu_transport_glue  # noqa: E402

BACKWARD = ("commit_backward", "group_done", "finish_release")


class _Native:
    """The C++ module with its backward functions counted (``use_cpp``), or standing aside so that the handler's
    Python bodies run (commit_backward and group_done answer False, finish_release calls ``_release_all``)."""

    def __init__(self, real, use_cpp: bool, answers: Counter):
        self._real, self._use_cpp, self._answers = real, use_cpp, answers

    def __getattr__(self, name):
        if name not in BACKWARD:
            return getattr(self._real, name)
        if not self._use_cpp:
            return (lambda handler, pool: handler._release_all()) if name == "finish_release" else (lambda *a: False)

        def counted(*args):
            answer = getattr(self._real, name)(*args)
            self._answers[name, answer is not False] += 1
            return answer

        return counted


def _train(rt, monkeypatch, use_cpp: bool, names, steps=4, microbatches=3, layers=5):
    """Training steps of the toy model over the logging stub runtime: (losses and gradients per step, the CUDA calls
    without addresses, the per-step counters, end state, how often each C++ function did the work or stood aside)."""
    answers: Counter = Counter()
    # the points' Python glue, whose hooks call the handler's methods (points_block.cpp's call backward.cpp directly)
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE_POINTS", "0")
    real = native_module.load_native()
    assert real is not None and all(hasattr(real, f) for f in BACKWARD)
    monkeypatch.setattr(manager_module, "load_native", lambda: _Native(real, use_cpp, answers))
    t = cpu_transport_glue.stub_transport(rt, -1, native=True, timed_from_start=True)
    cpu_transport_glue.stub_calls(rt)  # this run's calls only
    results = train_toy(names, steps, microbatches, layers, transport=t)
    calls = [(c[0], *c[3:]) if c[0] == "copy" else c for c in cpu_transport_glue.stub_calls(rt)]  # no addresses
    summary = get_summary()
    counters = [{p: dict(c) for p, c in s.points.items()} for s in summary.steps]
    state = {
        "reload_seq": t.reload_seq,
        "allocations": t.pool.allocations,
        "free": {cls: len(v) for cls, v in t.pool._free.items()},
        "host_resident": (summary.host_resident_bytes, summary.host_resident_peak_bytes),
        "off_device": summary.off_device_bytes,
        "handlers": len(manager_module.get_manager().handlers),
    }
    manager_module.reset()
    return results, calls, counters, state, answers


@pytest.mark.parametrize("names", [["core_attn"], ["qkv_linear", "core_attn", "attn_proj"]])
@pytest.mark.parametrize("prefetch", ["layer", "tail", "late"])
@pytest.mark.parametrize("flush_layers", ["1", "2"])
def test_the_cpp_backward_makes_the_python_backwards_calls_counts_and_values(
        monkeypatch, native_stub_runtime, names, prefetch, flush_layers):
    monkeypatch.setenv("MCORE_OFFLOAD_PREFETCH", prefetch)
    monkeypatch.setenv("MCORE_OFFLOAD_FLUSH_LAYERS", flush_layers)
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "1")
    py = _train(native_stub_runtime, monkeypatch, False, names)
    cpp = _train(native_stub_runtime, monkeypatch, True, names)
    for (l0, g0), (l1, g1) in zip(py[0], cpp[0]):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert cpp[1] == py[1]  # the CUDA calls, in order, with their events and streams
    assert cpp[2] == py[2] and cpp[3] == py[3]
    answers = cpp[4]
    # every chunk's first commit goes to Python (what forward left pending); the rest, and every group's end, in C++
    chunks = 4 * 3
    assert answers["commit_backward", False] == chunks
    assert answers["commit_backward", True] > 0 and answers["group_done", True] > 0
    assert answers["finish_release", True] == chunks and not answers["group_done", False]
    copies = [c for c in py[1] if c[0] == "copy"]
    assert len(copies) > 40 and py[3]["handlers"] == 0 and py[3]["host_resident"][0] == 0


def test_reload_bursts_of_several_layers_stay_with_python(monkeypatch, native_stub_runtime):
    monkeypatch.setenv("MCORE_OFFLOAD_RELOAD_LAYERS", "2")
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "1")
    py = _train(native_stub_runtime, monkeypatch, False, ["qkv_linear", "core_attn", "attn_proj"], steps=2)
    cpp = _train(native_stub_runtime, monkeypatch, True, ["qkv_linear", "core_attn", "attn_proj"], steps=2)
    assert cpp[1] == py[1] and cpp[2] == py[2]
    assert not cpp[4]["commit_backward", True] and cpp[4]["commit_backward", False] > 0
