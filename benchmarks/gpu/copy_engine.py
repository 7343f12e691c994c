"""An experiment, not part of the runtime: a native thread that makes the offload CUDA calls off the training thread.

Measured on the H100 host (``copy_thread_cost.py``, session 12) it made the training thread *slower* than making the
same calls inline (228 µs against 91 µs per emulated group): the CUDA driver serialises API calls of one context,
and two threads contending for it cost more than one thread making all the calls. It is kept, with its tests, so
that the result can be reproduced.

The idea: in a launch-bound step (config A on an H100) each CUDA call the runtime makes costs 8-10 µs of the training
thread's host time, 3-4x its cost outside the step (session 5's ``host_costs.py``: an event record 2.5 µs idle,
10-11 µs inside the step), and an offloaded group needs about 25 of them. The training thread instead builds one
job per copy burst (a list of integers) and appends it to a queue (one foreign call, no CUDA); the engine's
thread, written in C so that it never needs the GIL (``copy_engine.c``), issues the calls in order. A second
native thread confirms the completion of D2H bursts with a blocking event synchronize, so the training thread
learns that a copied device block may be freed by reading a counter, not by querying an event.

The C source is compiled on first use with the system's C compiler into a per-user cache
(``MCORE_OFFLOAD_CACHE_DIR``, default ``~/.cache/mcore_offload``).
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from mcore_offload.runtime.native import cache_dir  # the library's build cache

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("copy_engine.c")

#: operations of a job (see copy_engine.c)
OP_RECORD, OP_WAIT, OP_COPY, OP_COMPLETE = 1, 2, 3, 4
#: indices into the engine's counters
C_SUBMITTED, C_ISSUED, C_COMPLETIONS, C_COMPLETED, C_ERROR, C_ERROR_OP = range(6)
MAX_JOB_WORDS = 4096
_OP_NAMES = {0: "cudaSetDevice", OP_RECORD: "cudaEventRecord", OP_WAIT: "cudaStreamWaitEvent",
             OP_COPY: "cudaMemcpyAsync", OP_COMPLETE: "cudaEventSynchronize", -1: "a malformed job"}



def build_library(directory: Path | None = None) -> Path | None:
    """The compiled engine (built once per source version and machine type), or None without a C compiler.

    Concurrent ranks may build at once: each compiles into a temporary file and renames it into place, so a
    reader never sees a partial library.
    """
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
    directory = cache_dir() if directory is None else directory
    target = directory / f"copy_engine-{tag}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: no copy engine")
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
        os.close(fd)
        cmd = [compiler, "-O2", "-shared", "-fPIC", "-pthread", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            os.unlink(tmp)
            logger.info("building the copy engine failed (%s)", done.stderr.strip()[-200:] or done.returncode)
            return None
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as e:
        logger.info("building the copy engine failed (%s)", e)
        return None
    return target


def load_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.mco_start.argtypes, lib.mco_start.restype = [ctypes.POINTER(vp), ctypes.c_int, i64, i64], vp
    lib.mco_submit.argtypes, lib.mco_submit.restype = [vp, vp, i64], i64
    lib.mco_wait_issued.argtypes, lib.mco_wait_issued.restype = [vp, i64], None
    lib.mco_wait_completed.argtypes, lib.mco_wait_completed.restype = [vp, i64], None
    lib.mco_counters.argtypes, lib.mco_counters.restype = [vp], ctypes.POINTER(i64)
    lib.mco_stop.argtypes, lib.mco_stop.restype = [vp], None
    lib.mco_free.argtypes, lib.mco_free.restype = [vp], None
    return lib


class CopyEngine:
    """One engine (a worker and a reaper thread) per device.

    ``functions``: addresses of ``cudaSetDevice`` (or 0), ``cudaEventRecord``, ``cudaStreamWaitEvent``,
    ``cudaMemcpyAsync`` and ``cudaEventSynchronize``. ``error_string(code)`` names a CUDA error for messages.
    """

    def __init__(self, lib: ctypes.CDLL, functions: list[int], device_index: int,
                 error_string=None, cap_words: int = 1 << 16, reap_cap: int = 1 << 12) -> None:
        fns = (ctypes.c_void_p * 5)(*functions)
        self._lib = lib
        self._handle = lib.mco_start(fns, device_index, cap_words, reap_cap)
        if not self._handle:
            raise RuntimeError("the offload copy engine could not start its threads")
        self._fns = fns  # the function pointers must outlive the threads
        self.counters = lib.mco_counters(self._handle)
        self._submit = lib.mco_submit
        self._error_string = error_string
        self.completions = 0  # OP_COMPLETE operations submitted so far (the next one's index)
        self.submitted = 0

    def submit(self, ops: list[int]) -> int:
        """Queue one job; returns its index (it is issued once :meth:`issued` says so)."""
        if not 0 < len(ops) <= MAX_JOB_WORDS:
            raise ValueError(f"a copy-engine job has {len(ops)} words; it must have 1 to {MAX_JOB_WORDS}")
        words = array.array("q", ops)
        job = self._submit(self._handle, words.buffer_info()[0], len(words))
        if job < 0:
            raise RuntimeError("the offload copy engine refused a job; this is a bug, please report it")
        self.submitted = job + 1
        return job

    def completion(self, ops: list[int], event_handle: int) -> int:
        """Append to ``ops`` the confirmation of ``event_handle`` (recorded earlier in the job); returns the
        completion's index (:meth:`completed`). The event must not be recorded again before then."""
        ops += (OP_COMPLETE, event_handle)
        index = self.completions
        self.completions = index + 1
        return index

    def issued(self, job: int) -> bool:
        return self.counters[C_ISSUED] > job

    def wait_issued(self, job: int) -> None:
        """Block (without the GIL) until job ``job`` is issued; raises if a call failed."""
        if self.counters[C_ISSUED] <= job:
            self._lib.mco_wait_issued(self._handle, job)
        self.check()

    def completed(self, completion: int) -> bool:
        return self.counters[C_COMPLETED] > completion

    def wait_completed(self, completion: int) -> None:
        if self.counters[C_COMPLETED] <= completion:
            self._lib.mco_wait_completed(self._handle, completion)
        self.check()

    def drain(self) -> None:
        """Block until every job so far is issued and every completion confirmed (abort paths, step ends)."""
        if self.submitted:
            self.wait_issued(self.submitted - 1)
        if self.completions:
            self.wait_completed(self.completions - 1)

    def check(self) -> None:
        err = self.counters[C_ERROR]
        if err:
            what = _OP_NAMES.get(self.counters[C_ERROR_OP], "a CUDA call")
            text = self._error_string(err) if self._error_string is not None else f"error {err}"
            raise RuntimeError(f"{what} failed in the offload copy engine: {text}")

    def stop(self) -> None:
        """Issue what is queued, confirm every completion, end the threads (idempotent)."""
        if self._handle:
            handle, self._handle = self._handle, None
            self._lib.mco_stop(handle)
            self.counters = [self.counters[i] for i in range(C_ERROR_OP + 1)]  # the engine's memory goes next
            self._lib.mco_free(handle)
