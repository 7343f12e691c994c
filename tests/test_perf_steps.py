"""benchmarks/perf_steps.py: perf script's samples split into offloaded and plain steps, per thread and library."""

import collections
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import perf_steps  # noqa: E402

SCRIPT = """\
python3 100/100 10.0005:
\t    1234 cudaMemcpyAsync (/usr/lib/libcudart.so.13)
\t    5678 py::to_host:/x/transport.py (/tmp/perf-100.map)
\t    9abc copy_out (/cache/mcore_offload_hooks_abc.so)

pt_autograd_0 100/105 10.0105:
\t    1234 _PyEval_EvalFrameDefault (/usr/lib/libpython3.12.so)

python3 100/100 10.0205:
\t    1234 some_kernel_launch (/usr/lib/libtorch_cuda.so)

python3 100/100 10.0305:
\t    1234 some_kernel_launch (/usr/lib/libtorch_cuda.so)

python3 100/100 11.5:
\t    1234 outside_every_step (/usr/lib/libtorch_cuda.so)

python3 200/200 10.0005:
\t    1234 another_rank (/usr/lib/libtorch_cuda.so)

python3 100/100 10.0000:
\t    1234 warm_up (/usr/lib/libtorch_cuda.so)
"""


def run_json(pid=100):
    # step 0 is warm-up (9.99-10.0005); step 1 on (10.0-10.015); step 2 off (10.02-10.04)
    row = {"rank": 0, "pid": pid, "step_ms": [10.0, 15.0, 20.0],
           "host_clock": {"start_monotonic": [9.99, 10.0001, 10.02]},
           "alternation": {"on_steps": [True, True, False]}}
    return {"args": {"warmup_steps": 1}, "ranks": [row]}


def test_samples_parse_with_their_call_chains_innermost_first():
    samples = list(perf_steps.read_samples(SCRIPT.splitlines(keepends=True)))
    assert len(samples) == 7
    comm, pid, tid, t, frames = samples[0]
    assert (comm, pid, tid, t) == ("python3", 100, 100, 10.0005)
    assert frames == [("cudaMemcpyAsync", "libcudart.so.13"), ("py::to_host:/x/transport.py", "perf-100.map"),
                      ("copy_out", "mcore_offload_hooks_abc.so")]
    assert samples[1][:3] == ("pt_autograd_0", 100, 105)


def test_a_sample_without_call_chain_keeps_its_one_frame():
    line = "python3 7/8 1.25:   deadbeef cuLaunchKernel (/usr/lib/libcuda.so.1)\n"
    assert list(perf_steps.read_samples([line])) == [("python3", 7, 8, 1.25, [("cuLaunchKernel", "libcuda.so.1")])]


def test_each_sample_goes_to_its_steps_kind_and_warm_up_and_gaps_and_other_pids_count_nowhere():
    run = run_json()
    samples = perf_steps.read_samples(SCRIPT.splitlines(keepends=True))
    out, text = perf_steps.report(run, samples, period_ns=1_000_000, top=5)
    rows = {r["key"]: r for r in out["ranks"][0]["rows"]}
    assert out["ranks"][0]["steps"] == {"on": 1, "off": 1}
    # on (step 1): the main thread's copy sample and the autograd thread's; off (step 2): two launches
    assert rows["thread main"]["on_ms"] == 1.0 and rows["thread main"]["off_ms"] == 2.0
    assert rows["thread pt_autograd_N"]["on_ms"] == 1.0 and rows["thread pt_autograd_N"]["off_ms"] == 0.0
    assert rows["ours main"]["diff_ms"] == 1.0
    assert rows["ours-entry main copy_out"]["on_ms"] == 1.0 and rows["ours-caller main (none)"]["on_ms"] == 1.0
    assert rows["under-ours main libcudart.so.13:cudaMemcpyAsync"]["on_ms"] == 1.0
    assert rows["ours-python main to_host:/x/transport.py"]["on_ms"] == 1.0  # the Python our C++ called back into
    assert rows["python main to_host:/x/transport.py"]["on_ms"] == 1.0
    assert rows["incl main mcore_offload_hooks_abc.so"]["on_ms"] == 1.0
    assert rows["self libtorch_cuda.so:some_kernel_launch"]["diff_ms"] == -2.0
    assert not any("outside_every_step" in k or "another_rank" in k or "warm_up" in k for k in rows)
    assert "rank 0 (pid 100): 1 offloaded and 1 plain steps" in text


def test_a_run_without_the_monotonic_starts_is_refused_in_one_sentence():
    run = run_json()
    del run["ranks"][0]["host_clock"]["start_monotonic"]
    with pytest.raises(SystemExit, match="no start_monotonic or pid"):
        perf_steps.report(run, [], period_ns=1_000_000, top=5)


def test_the_standard_error_follows_the_counts():
    counts = {"on": collections.Counter({"k": 100}), "off": collections.Counter({"k": 25})}
    (row,) = perf_steps.table(counts, collections.Counter({"on": 10, "off": 5}), period_ns=1_000_000)
    assert (row["on_ms"], row["off_ms"], row["diff_ms"]) == (10.0, 5.0, 5.0)
    assert row["se_ms"] == pytest.approx((100 / 100 + 25 / 25) ** 0.5, abs=1e-3)


@pytest.mark.skipif(shutil.which("perf") is None, reason="needs perf")
def test_on_a_real_perf_capture_the_main_thread_is_seen(tmp_path):
    """perf record of a tiny Python loop with two 'steps' whose monotonic windows come from the process itself."""
    prog = ("import json, os, sys, time\n"
            "starts, ms = [], []\n"
            "for i in range(3):\n"
            "    t = time.monotonic(); starts.append(t)\n"
            "    end = time.thread_time() + 0.05\n"
            "    while time.thread_time() < end: pass\n"
            "    ms.append((time.monotonic() - t) * 1e3)\n"
            "json.dump({'args': {'warmup_steps': 1}, 'ranks': [{'rank': 0, 'pid': os.getpid(), 'step_ms': ms,"
            " 'host_clock': {'start_monotonic': starts}, 'alternation': {'on_steps': [True, True, False]}}]},"
            " open(sys.argv[1], 'w'))\n")
    data, js = tmp_path / "p.data", tmp_path / "run.json"
    rec = subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-c", "1000000", "-k", "mono", "-o", str(data),
                          "--", sys.executable, "-c", prog, str(js)], capture_output=True, text=True, timeout=120)
    if rec.returncode != 0 or not js.exists():
        pytest.skip(f"perf record is not allowed here: {rec.stderr.strip()[-200:]}")
    script = subprocess.run(["perf", "script", "-i", str(data), "-F", "comm,pid,tid,time,ip,sym,dso"],
                            capture_output=True, text=True, timeout=120)
    out, _ = perf_steps.report(json.loads(js.read_text()),
                               perf_steps.read_samples(script.stdout.splitlines(keepends=True)), 1_000_000, 5)
    rows = {r["key"]: r for r in out["ranks"][0]["rows"]}
    assert rows["thread main"]["on_ms"] > 20 and rows["thread main"]["off_ms"] > 20
