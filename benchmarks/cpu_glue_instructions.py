"""CPU measurement without the noise: instructions the offload runtime adds to a training step, counted by callgrind.

On this 2-core development machine a step's wall time moves by several milliseconds from run to run, more than most
glue changes save (``cpu_pipeline_host.py --paired``). Instructions retired are deterministic. This runs the tests'
tiny dense GPT (megatron-core's local spec, PP=1, gloo) over the stub CUDA runtime of ``cpu_transport_glue.py``
under ``valgrind --tool=callgrind``, counting only the measured steps (``CALLGRIND_START_INSTRUMENTATION`` around
them, from a small C library built on the fly), once per mode:

- ``on``: the points offload (with ``--min-size`` above every activation, the default, they run and nothing moves);
- ``off``: the same steps inside ``mcore_offload.paused()`` (the patches and the runtime in place, every point on
  its cheap exit), which is the plain step of ``pretrain_gpt.py --alternate-offload``.

It prints the instructions a step in each mode, the difference per layer-microbatch, and that difference by shared
object (the Python interpreter, libc, torch, our C++ module). Instructions are not time: a GIL hand-off or a cache
miss costs more than its count. Read it as a noise-free proxy for comparing two versions of the glue.

    python benchmarks/cpu_glue_instructions.py [--min-size N] [--layers 16] [--microbatches 8] [--json-out FILE]

Needs valgrind with its headers (``valgrind/callgrind.h``) and a C compiler. About five minutes a mode (most of it
the imports under valgrind).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOGGLE_C = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""
POINTS = ["qkv_linear", "core_attn", "attn_proj"]


def worker(mode: str, toggle: str, args: argparse.Namespace) -> None:
    """One process under callgrind: warm-up steps, then ``args.steps`` counted steps in ``mode``."""
    import ctypes

    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    import cpu_transport_glue
    from cpu_pipeline_host import stub_gpt

    from mcore_offload import paused
    from tests.harness.gpt import run_steps

    lib = ctypes.CDLL(toggle)
    with tempfile.TemporaryDirectory() as tmp:
        stub = cpu_transport_glue.stub_library(Path(tmp), real_copies=True)
        chunks, kw = stub_gpt(stub, 1, 0, None, POINTS, args.min_size, args.layers, args.microbatches)
        run_steps(chunks, n_steps=2, **kw)  # the first offloading steps allocate and announce
        with contextlib.nullcontext() if mode == "on" else paused():
            run_steps(chunks, n_steps=1, **kw)
            lib.cg_start()
            run_steps(chunks, n_steps=args.steps, **kw)
            lib.cg_stop()


def build_toggle(workdir: Path) -> str:
    """The small library whose two functions start and stop callgrind's counting, built in ``workdir``."""
    (workdir / "toggle.c").write_text(TOGGLE_C)
    toggle = str(workdir / "libtoggle.so")
    build = subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", toggle, str(workdir / "toggle.c")],
                           capture_output=True, text=True)
    if build.returncode != 0:
        raise SystemExit(f"building the callgrind toggle failed (are valgrind's headers installed?):\n{build.stderr}")
    return toggle


def object_name(name: str) -> str:
    """A shared object's file name without our module's build hash (``mcore_offload_hooks_<12 hex>.so``), so that
    two builds' counts add up under one name."""
    return re.sub(r"_[0-9a-f]{12}\.so$", ".so", name)


def by_object(annotate_out: str) -> collections.Counter:
    """Self instructions per shared object from ``callgrind_annotate``'s function list."""
    out: collections.Counter = collections.Counter()
    for line in annotate_out.splitlines():
        m = re.match(r"\s*([\d,]+) \([\s\d.]+%\)\s+(.*)$", line)
        if m is None or "PROGRAM TOTALS" in line:
            continue
        obj = re.search(r"\[([^\]]*)\]$", m.group(2))
        name = Path(obj.group(1)).name if obj else ("libpython (inlined)" if "Python-" in m.group(2) else "?")
        out[object_name(name)] += int(m.group(1).replace(",", ""))
    return out


def count(mode: str, toggle: str, args: argparse.Namespace, workdir: Path) -> tuple[int, collections.Counter]:
    out_file = workdir / f"{mode}.callgrind"
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}", sys.executable,
           __file__, "--worker", mode, "--toggle", toggle, "--min-size", str(args.min_size), "--layers",
           str(args.layers), "--microbatches", str(args.microbatches), "--steps", str(args.steps)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    total = re.search(r"I\s+refs:\s+([\d,]+)", run.stderr)
    if run.returncode != 0 or total is None:
        raise SystemExit(f"callgrind run ({mode}) failed:\n{run.stderr[-3000:]}")
    annotate = subprocess.run(["callgrind_annotate", "--threshold=100", str(out_file)], capture_output=True,
                              text=True, check=True).stdout
    return int(total.group(1).replace(",", "")), by_object(annotate)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-size", type=int, default=2**40,
                   help="min_offloaded_tensor_size (elements); the default moves nothing, 512 moves the activations")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=1, help="counted steps a mode")
    p.add_argument("--json-out", default=None)
    p.add_argument("--keep-dir", default=None,
                   help="also copy each mode's callgrind output here (for callgrind_annotate by function)")
    p.add_argument("--worker", choices=["on", "off"], help=argparse.SUPPRESS)
    p.add_argument("--toggle", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.toggle, args)
        return 0
    missing = [t for t in ("valgrind", "callgrind_annotate", "cc") if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"cpu_glue_instructions.py needs {', '.join(missing)} on PATH: install valgrind and a C "
                         "compiler")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        toggle = build_toggle(workdir)
        results = {}
        for mode in ("on", "off"):
            print(f"mode {mode}: counting under callgrind (about five minutes) ...", flush=True)
            results[mode] = count(mode, toggle, args, workdir)
            if args.keep_dir:
                Path(args.keep_dir).mkdir(parents=True, exist_ok=True)
                shutil.copy(workdir / f"{mode}.callgrind", Path(args.keep_dir) / f"{mode}.callgrind")
    layer_mb = args.layers * args.microbatches
    (on, on_obj), (off, off_obj) = results["on"], results["off"]
    added = (on - off) / args.steps
    print(f"instructions a step: on {on / args.steps:,.0f}, off {off / args.steps:,.0f}; added {added:,.0f} "
          f"({added / layer_mb:,.0f} a layer-microbatch, {layer_mb} a step)")
    diff = {k: (on_obj[k] - off_obj[k]) / args.steps for k in set(on_obj) | set(off_obj)}
    for name, d in sorted(diff.items(), key=lambda kv: -kv[1]):
        if abs(d) >= 0.01 * abs(added):
            print(f"  {d:>14,.0f}  {name}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "toggle")},
            "instructions_per_step": {"on": on / args.steps, "off": off / args.steps},
            "added_per_step": added, "added_per_layer_microbatch": added / layer_mb,
            "added_by_object": {k: v for k, v in sorted(diff.items(), key=lambda kv: -kv[1]) if v}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
