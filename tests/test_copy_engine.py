"""The native copy engine experiment (benchmarks/gpu/copy_engine.c) driven by fake CUDA entry points on the CPU.

The fakes are ctypes callbacks: the engine's threads call them as they would call the CUDA runtime, and they
log what they were asked to do, so the tests see the order of calls, the counters and the error path.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import copy_engine as ce  # noqa: E402

RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
ONE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
SET_DEVICE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    path = ce.build_library(tmp_path_factory.mktemp("engine"))
    if path is None:
        pytest.skip("no C compiler")
    return ce.load_library(path)


class FakeCuda:
    """Logs every call; ``gate`` holds event synchronizes until set; ``fail_on`` makes one kind of call fail."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on = fail_on
        self.threads: set[int] = set()

        def log(kind, *args):
            self.calls.append((kind, *(a or 0 for a in args)))  # ctypes passes a null pointer as None
            self.threads.add(threading.get_ident())
            return 700 if kind == fail_on else 0

        def sync(ev):
            self.gate.wait(10)
            return log("sync", ev)

        self._fns = [SET_DEVICE(lambda d: log("set_device", d)), RECORD(lambda ev, s: log("record", ev, s)),
                     WAIT(lambda s, ev, f: log("wait", s, ev)),
                     COPY(lambda dst, src, n, kind, s: log("copy", dst, src, n, kind, s)), ONE(sync)]

    def addresses(self) -> list[int]:
        return [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]


def _engine(lib, fake, **kw) -> ce.CopyEngine:
    return ce.CopyEngine(lib, fake.addresses(), 3, lambda e: f"fake error {e}", **kw)


def test_jobs_run_in_order_on_the_engine_thread(lib):
    fake = FakeCuda()
    engine = _engine(lib, fake)
    try:
        ops = [ce.OP_RECORD, 11, 1, ce.OP_WAIT, 2, 11, ce.OP_COPY, 100, 200, 64, 2, 2, ce.OP_RECORD, 12, 2]
        j0 = engine.submit(ops)
        j1 = engine.submit([ce.OP_WAIT, 3, 12, ce.OP_COPY, 300, 100, 64, 1, 3])
        assert (j0, j1) == (0, 1)
        engine.wait_issued(j1)
        assert engine.issued(j0) and engine.issued(j1)
    finally:
        engine.stop()
    assert fake.calls.count(("set_device", 3)) == 2  # both threads work on the transport's device
    work = [c for c in fake.calls if c[0] != "set_device"]
    assert work == [("record", 11, 1), ("wait", 2, 11), ("copy", 100, 200, 64, 2, 2), ("record", 12, 2),
                    ("wait", 3, 12), ("copy", 300, 100, 64, 1, 3)]
    assert threading.get_ident() not in fake.threads  # every call came from the engine's own threads


def test_completion_is_confirmed_after_the_event_synchronize(lib):
    fake = FakeCuda()
    fake.gate.clear()  # the "GPU" has not finished yet
    engine = _engine(lib, fake)
    try:
        ops = [ce.OP_COPY, 1, 2, 8, 2, 5, ce.OP_RECORD, 42, 5]
        k = engine.completion(ops, 42)
        engine.wait_issued(engine.submit(ops))
        time.sleep(0.05)
        assert not engine.completed(k)  # issued, but the event has not completed
        fake.gate.set()
        engine.wait_completed(k)
        assert engine.completed(k)
        assert ("sync", 42) in fake.calls
        # completions count in submission order
        k2 = engine.completion(ops2 := [ce.OP_RECORD, 43, 5], 43)
        engine.submit(ops2)
        engine.drain()
        assert k2 == k + 1 and engine.completed(k2)
    finally:
        engine.stop()


def test_stop_issues_and_confirms_everything_queued(lib):
    fake = FakeCuda()
    engine = _engine(lib, fake)
    for i in range(200):
        ops = [ce.OP_COPY, i, i, 1, 2, 9, ce.OP_RECORD, 1000 + i, 9]
        engine.completion(ops, 1000 + i)
        engine.submit(ops)
    engine.stop()
    assert engine.counters[ce.C_ISSUED] == 200 and engine.counters[ce.C_COMPLETED] == 200
    assert sum(1 for c in fake.calls if c[0] == "sync") == 200
    engine.stop()  # idempotent


def test_ring_full_blocks_the_submitter_until_the_worker_catches_up(lib):
    fake = FakeCuda()
    engine = _engine(lib, fake, cap_words=64)  # room for a few jobs only
    try:
        for i in range(100):
            engine.submit([ce.OP_COPY, i, i, 1, 2, 9])
        engine.drain()
    finally:
        engine.stop()
    assert [c[1] for c in fake.calls if c[0] == "copy"] == list(range(100))


def test_a_failing_call_is_reported_in_one_sentence(lib):
    fake = FakeCuda(fail_on="copy")
    engine = _engine(lib, fake)
    try:
        job = engine.submit([ce.OP_COPY, 1, 2, 8, 2, 5, ce.OP_RECORD, 7, 5])
        with pytest.raises(RuntimeError, match=r"cudaMemcpyAsync failed in the offload copy engine: fake error 700"):
            engine.wait_issued(job)
        assert ("record", 7, 5) in fake.calls  # the job still ran to its end: nothing waits forever
    finally:
        engine.stop()


def test_bad_jobs_are_refused(lib):
    fake = FakeCuda()  # held to the end: the engine's threads call its callbacks (a temporary here crashed, rarely)
    engine = _engine(lib, fake)
    try:
        with pytest.raises(ValueError, match="1 to 4096"):
            engine.submit([])
        with pytest.raises(ValueError, match="1 to 4096"):
            engine.submit([ce.OP_RECORD, 1, 1] * 2000)
        bad = engine.submit([99, 1, 2])
        with pytest.raises(RuntimeError, match="a malformed job"):
            engine.wait_issued(bad)
    finally:
        engine.stop()
    assert fake.calls  # the threads ran (and called the fake) while it was alive


def test_library_is_built_once_and_reused(tmp_path, monkeypatch):
    first = ce.build_library(tmp_path)
    if first is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("CC", "/nonexistent/cc")  # a rebuild would fail: the cached library must be found
    assert ce.build_library(tmp_path) == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind


def test_no_compiler_means_no_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert ce.build_library(tmp_path) is None
