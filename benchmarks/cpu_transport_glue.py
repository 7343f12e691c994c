"""CPU microbenchmark: the Python around the CUDA calls of one copy burst (``RawCudaTransport.to_host`` and
``to_device``), with the CUDA runtime replaced by a stub library whose entry points return at once.

On the GPU host a burst of four storages costs 114-139 µs of host time inside a launch-bound step (session 21's
breakdown of D-dense ``core_attn``). This measures how much of that is the transport's own Python (pool, events,
loops, telemetry): what moving the burst into C++ could save at most. The rest is the CUDA calls themselves (about
eight a burst: the completion query of ``release_copied``, a fence record and wait, one copy per storage, the done
event). ``to_device`` runs with the Python allocations and copy loop here (its C++ allocations need a GPU), so it
is an upper bound of its glue. Needs a C compiler (``cc``) for the stub:

    python benchmarks/cpu_transport_glue.py [--storages 4] [--calls 5000] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import itertools
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mcore_offload.runtime import cudart  # noqa: E402
from mcore_offload.runtime import raw_transport as raw_transport_module  # noqa: E402
from mcore_offload.runtime import transport as transport_module  # noqa: E402
from mcore_offload.runtime.coalesce import coalesce_reloads  # noqa: E402
from mcore_offload.runtime.host_pool import HostBufferPool  # noqa: E402
from mcore_offload.runtime.native import load_native  # noqa: E402
from mcore_offload.runtime.telemetry import LinkTelemetry  # noqa: E402

logger = logging.getLogger("cpu_transport_glue")

# Every entry point CudaRuntime binds, each returning success at once (events get distinct handles; every event is
# complete when queried, unless stub_busy is set: stub_set_busy). Built with STUB_REAL_COPY, the copies are real
# (synchronous memcpy): tests run the raw transport end to end on CPU tensors with it
# (tests/test_raw_transport_stub.py).
# Built with STUB_LOG, it also logs every record, wait, query and copy in call order (stub_log: op, then up to five
# arguments; tests/test_stream_order.py checks the hand-offs between streams from it).
STUB_SOURCE = """
#include <string.h>
#ifdef STUB_LOG
#define STUB_LOG_MAX (1 << 20)
static long stub_log_rows[STUB_LOG_MAX][6];
static long stub_log_n = 0;
static void stub_note(long op, long a, long b, long c, long d, long e) {
  if (stub_log_n < STUB_LOG_MAX) {
    long* r = stub_log_rows[stub_log_n++];
    r[0] = op; r[1] = a; r[2] = b; r[3] = c; r[4] = d; r[5] = e;
  }
}
long stub_log_size(void) { return stub_log_n; }
long* stub_log(void) { return &stub_log_rows[0][0]; }
void stub_log_clear(void) { stub_log_n = 0; }
#else
#define stub_note(op, a, b, c, d, e)
#endif
int cudaEventRecord(void* e, void* s) { stub_note(1, (long)e, (long)s, 0, 0, 0); return 0; }
int cudaStreamWaitEvent(void* s, void* e, unsigned f) { stub_note(2, (long)s, (long)e, 0, 0, 0); return 0; }
static int stub_busy = 0;  /* stub_set_busy(1): every event reads "not ready" (600), as behind a slow link */
void stub_set_busy(int busy) { stub_busy = busy; }
int cudaEventQuery(void* e) { stub_note(3, (long)e, 0, 0, 0, 0); return stub_busy ? 600 : 0; }
int cudaMemcpyAsync(void* d, const void* s, unsigned long n, int k, void* st) {
  stub_note(4, (long)d, (long)s, (long)n, k, (long)st);
#ifdef STUB_REAL_COPY
  memcpy(d, s, n);
#endif
  return 0;
}
int cudaEventCreateWithFlags(void** e, unsigned f) { static long n = 1; *e = (void*)(n++); return 0; }
int cudaEventSynchronize(void* e) { return 0; }
int cudaEventElapsedTime(float* ms, void* a, void* b) { *ms = 0.1f; return 0; }
int cudaHostAlloc(void** p, unsigned long n, unsigned f) { return 1; }
int cudaFreeHost(void* p) { return 0; }
const char* cudaGetErrorString(int e) { return "stub"; }
int cudaRuntimeGetVersion(int* v) { *v = 12000; return 0; }
"""


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def stub_runtime(workdir: Path, real_copies: bool = False, log: bool = False) -> cudart.CudaRuntime:
    """The stub CUDA runtime, compiled into ``workdir`` (``real_copies``: cudaMemcpyAsync copies, synchronously;
    ``log``: it logs its calls, read back with :func:`stub_calls`)."""
    cc = compiler()
    if cc is None:
        raise SystemExit("cpu_transport_glue.py needs a C compiler (cc or gcc) to build its stub CUDA runtime: "
                         "install one, or run it where one exists")
    name = "libstubcudart" + ("_copy" if real_copies else "") + ("_log" if log else "") + ".so"
    src, lib = workdir / "stub.c", workdir / name
    src.write_text(STUB_SOURCE)
    flags = (["-DSTUB_REAL_COPY"] if real_copies else []) + (["-DSTUB_LOG"] if log else [])
    subprocess.run([cc, "-O2", "-shared", "-fPIC", *flags, "-o", str(lib), str(src)], check=True)
    return cudart.CudaRuntime(ctypes.CDLL(str(lib)))


def stub_library(workdir: Path, real_copies: bool = False) -> str:
    """:func:`stub_runtime` built into ``workdir``, as the path of its shared library (for worker processes, which
    load it themselves)."""
    stub_runtime(workdir, real_copies=real_copies)
    return str(next(workdir.glob("libstubcudart*.so")))


STUB_OPS = {1: "record", 2: "wait", 3: "query", 4: "copy"}


def stub_set_busy(rt: cudart.CudaRuntime, busy: bool) -> None:
    """Make every event of the stub runtime ``rt`` read "not ready" when queried (``busy``), or complete."""
    rt._lib.stub_set_busy(int(busy))


def stub_calls(rt: cudart.CudaRuntime, clear: bool = True) -> list[tuple]:
    """The calls a ``log`` stub runtime received, in order: ``("record", event, stream)``, ``("wait", stream,
    event)``, ``("query", event)``, ``("copy", dst, src, nbytes, kind, stream)``."""
    lib = rt._lib
    lib.stub_log_size.restype = ctypes.c_long
    lib.stub_log.restype = ctypes.POINTER(ctypes.c_long)
    n, rows = lib.stub_log_size(), lib.stub_log()
    width = {1: 2, 2: 2, 3: 1, 4: 5}
    out = [(STUB_OPS[rows[6 * i]], *(rows[6 * i + 1 + k] for k in range(width[rows[6 * i]]))) for i in range(n)]
    if clear:
        lib.stub_log_clear()
    return out


class _NoStream:
    """Stands for the side streams, which the stub transport never creates: nothing to wait for."""

    def synchronize(self) -> None:
        return None


def stub_transport(rt: cudart.CudaRuntime, device_index: int = 0, native: bool = False,
                   timed_from_start: bool = False) -> raw_transport_module.RawCudaTransport:
    """A RawCudaTransport over CPU memory on the stub runtime, built without CUDA streams (its constructor needs a
    GPU). ``device_index`` -1: the C++ reload allocations make CPU storages (0 would ask for CUDA ones).
    ``native``: with the C++ copy loop and reload allocations. ``timed_from_start``: the link telemetry times steps
    0-3 and every 4th, as on the GPU (else the first step is untimed, as three in four are). Events get distinct
    handles, recycled when their last reference goes, as on the GPU (a replay of the calls tells them apart)."""
    t = object.__new__(raw_transport_module.RawCudaTransport)
    transport_module.Transport.__init__(t)
    t.pool = HostBufferPool(pin=False)
    t.device, t.device_index = torch.device("cpu"), device_index
    t.d2h_stream = t.h2d_stream = _NoStream()
    t.rt, t._memcpy = rt, rt.memcpy
    t.native = load_native() if native else None
    pool = t._timed_events = cudart.EventPool(rt, 0, timed=True)
    if t.native is not None:  # as RawCudaTransport makes them
        pool.event_type = cudart.native_event_type(t.native)
    free, handles = pool.free, itertools.count(100)
    pool.get = lambda: pool.event_type(rt, free.pop() if free else next(handles), free)
    t.telemetry = LinkTelemetry(pool.get, every=4)
    t.telemetry.timing = timed_from_start
    t._d2h_fence, t._h2d_fence = cudart.RawEvent(rt, 8, []), cudart.RawEvent(rt, 9, [])
    t._d2h_handle, t._h2d_handle = 1, 2
    t._held, t._streams = collections.deque(), {}
    t.d2h_in_flight = transport_module.d2h_in_flight_from_env()
    t.wait_at_forward_end = transport_module.forward_end_from_env() == "wait"
    t.coalesce, t._slices_left, t._last_h2d_done = coalesce_reloads(), {}, None
    t._compute_handle = lambda: 3
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storages", type=int, default=4, help="storages per burst")
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        t = stub_transport(stub_runtime(Path(tmp)))
        n, size = args.storages, 1 << 16
        storages = [torch.empty(size, dtype=torch.uint8).untyped_storage() for _ in range(n)]
        keep = [torch.empty(1) for _ in range(n)]
        hosts = [torch.empty(size, dtype=torch.uint8) for _ in range(n)]
        d2h_done = cudart.RawEvent(t.rt, 10, [])
        results = {}
        for label, native in (("to_host (C++ copy loop)", load_native()), ("to_device (Python allocations)", None)):
            t.native = native
            for _pass in range(2):  # the first pass warms up
                t0 = time.perf_counter_ns()
                for _ in range(args.calls):
                    if label.startswith("to_host"):
                        bufs, done = t.to_host(storages, keep, [None] * n)
                        t._held.clear()
                        for b in bufs:
                            t.pool.release(b, done)
                    else:
                        t.to_device(hosts, [size] * n, [d2h_done] * n, t.device)
                us = (time.perf_counter_ns() - t0) / args.calls / 1e3
            results[label] = round(us, 2)
            logger.info("%-32s %6.2f µs a burst of %d storages (stub CUDA calls)", label, us, n)
        t0 = time.perf_counter_ns()
        for _ in range(args.calls):
            t.rt.event_record(5, 6)
        results["one ctypes call"] = round((time.perf_counter_ns() - t0) / args.calls / 1e3, 3)
        logger.info("%-32s %6.3f µs", "one ctypes call", results["one ctypes call"])
    row = {"storages": n, "calls": args.calls, "us_per_burst": results, "torch": torch.__version__,
           "python": sys.version.split()[0], "native_loop": load_native() is not None}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
