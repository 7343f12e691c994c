"""Cache misses the offload runtime adds to a training step, counted by callgrind's cache simulator on the CPU.

Why: on the GPU host the runtime's own code spends its time on cold cache lines, not on instructions (session 49's
``perf`` profile: its attribute cache alone cost about 95 ns an access). Between two runtime calls the model's
forward or backward runs and pushes the runtime's objects out of the core's caches, so what the runtime pays is
about one miss per distinct cache line it touches in each call. Instructions (``cpu_glue_instructions.py``) do not
see that: sessions 46–48 cut them by a third and the GPU host's clock moved by a few per cent. This counts the
misses, deterministically, in the same runs as ``cpu_glue_instructions.py`` (the tests' tiny dense GPT over the
stub CUDA runtime, one counted step ``on`` and one ``off``), with a simulated core cache shaped like the GPU
host's (Xeon, model 207): L1d 48 KiB 12-way and, as the last level, the core's 2 MiB 16-way L2. A line missed
there comes from the shared L3 or from memory on that host.

It prints, per layer-microbatch, what the ``on`` step adds over the ``off`` step (instructions, L1d misses, L2
misses) by shared object, the functions that add the most L2 misses, and the misses while our C++ module's code
runs: its own plus those of the calls it makes into other objects (the interpreter, libc, torch), from the call
sites' inclusive costs, with and without the stub CUDA runtime's copies (a call back into our module from inside
another object is counted twice there: in the outer call's cost and as our own; the runtime makes few, session 45).
``--min-size 512`` (the default) moves the activations, so the runtime's copy and reload bookkeeping runs; the stub
copies with ``memcpy``, whose misses land on libc and are not the GPU host's.

    python benchmarks/cpu_cache_misses.py [--min-size N] [--layers 16] [--microbatches 8] [--json-out FILE]

Needs valgrind (with ``valgrind/callgrind.h``) and a C compiler; about ten minutes a mode on the 2-core machine.
Counts, not times; the simulated cache is one core's, without the prefetchers.
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_glue_instructions  # noqa: E402
from callgrind_boundary import Position  # noqa: E402

#: the simulated caches (size, associativity, line), after the GPU host's cores
CACHES = ["--I1=32768,8,64", "--D1=49152,12,64", "--LL=2097152,16,64"]
OUR_OBJECT = "mcore_offload_hooks"
STUB_OBJECT = "libstubcudart"  # the stub CUDA runtime (cpu_transport_glue.py): its copies are memcpy here
#: the figures reported, as sums of callgrind's events
FIGURES = {"instructions": ("Ir",), "l1d_misses": ("D1mr", "D1mw"), "l2_misses": ("DLmr", "DLmw", "ILmr")}


def _costs(parts: list[str], n: int) -> list[int]:
    """The event costs of one cost line (its first field is the position), zero-filled to ``n``."""
    values = [int(v) for v in parts[1:1 + n]]
    return values + [0] * (n - len(values))


def _add(acc: list[int], costs: list[int]) -> None:
    for i, c in enumerate(costs):
        acc[i] += c


def read_profile(path: Path, ours: str = OUR_OBJECT) -> dict:
    """Per-function self costs and, for functions of objects matching ``ours``, the inclusive costs of their calls
    into other objects. Returns ``events`` (names), ``self`` ({(object, function): [costs]}) and ``boundary``
    ({(function, callee object): [costs]})."""
    pos = Position()
    events: list[str] = []
    own: dict = collections.defaultdict(lambda: [0] * len(events))
    boundary: dict = collections.defaultdict(lambda: [0] * len(events))
    after_calls = False
    with open(path, errors="replace") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not line:
                continue
            if line[0].isdigit() or line[0] in "+-*":
                costs = _costs(line.split(), len(events))
                if after_calls:  # the callee's inclusive cost, at the call site
                    callee_ob = pos.callee_object()
                    if pos.ob and ours in pos.ob and callee_ob and ours not in callee_ob:
                        _add(boundary[(pos.fn, Path(callee_ob).name)], costs)
                    after_calls, pos.cob = False, None
                else:
                    _add(own[(Path(pos.ob or "?").name, pos.fn)], costs)
                continue
            if line.startswith("events:"):
                events = line.split(":", 1)[1].split()
                continue
            key, _, value = line.partition("=")
            if not pos.read(key, value) and key == "calls":
                after_calls = True
    return {"events": events, "self": dict(own), "boundary": dict(boundary)}


def figures(costs: list[int], events: list[str]) -> dict[str, int]:
    """``FIGURES`` from one cost vector."""
    index = {e: i for i, e in enumerate(events)}
    return {name: sum(costs[index[e]] for e in parts if e in index) for name, parts in FIGURES.items()}


def summarize(on: dict, off: dict, per: float, ours: str = OUR_OBJECT, top: int = 15) -> dict:
    """What ``on`` adds over ``off``, divided by ``per``: by object, by function (top ``top`` by L2 misses) and inside
    our module's calls (its own code plus its calls into other objects)."""
    def totals(profile: dict, key) -> collections.defaultdict:
        out: collections.defaultdict = collections.defaultdict(lambda: collections.Counter())
        for k, costs in profile["self"].items():
            out[key(k)].update(figures(costs, profile["events"]))
        return out

    def diff(a: dict, b: dict) -> dict:
        keys = set(a) | set(b)
        return {k: {f: (a.get(k, {}).get(f, 0) - b.get(k, {}).get(f, 0)) / per for f in FIGURES} for k in keys}

    name = cpu_glue_instructions.object_name
    by_object = diff(totals(on, lambda k: name(k[0])), totals(off, lambda k: name(k[0])))
    by_function = diff(totals(on, lambda k: f"{k[1]} [{name(k[0])}]"), totals(off, lambda k: f"{k[1]} [{name(k[0])}]"))

    def inside(profile: dict, skip: str | None = None) -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for (obj, _fn), costs in profile["self"].items():
            if ours in obj:
                out.update(figures(costs, profile["events"]))
        for (_fn, callee), costs in profile["boundary"].items():
            if skip is None or skip not in callee:
                out.update(figures(costs, profile["events"]))
        return out

    inside_on, inside_off = inside(on), inside(off)
    # the stub CUDA runtime's copies are memcpy on this machine, a DMA engine's work on the GPU host
    runtime_on, runtime_off = inside(on, STUB_OBJECT), inside(off, STUB_OBJECT)
    return {
        "added_by_object": dict(sorted(by_object.items(), key=lambda kv: -kv[1]["l2_misses"])),
        "top_functions_by_l2_misses": dict(sorted(by_function.items(), key=lambda kv: -kv[1]["l2_misses"])[:top]),
        "inside_our_module": {"on": {f: inside_on[f] / per for f in FIGURES},
                              "off": {f: inside_off[f] / per for f in FIGURES}},
        "inside_our_module_without_the_stub_copies": {"on": {f: runtime_on[f] / per for f in FIGURES},
                                                      "off": {f: runtime_off[f] / per for f in FIGURES}},
    }


def run_mode(mode: str, toggle: str, args: argparse.Namespace, workdir: Path) -> dict:
    out_file = workdir / f"{mode}.callgrind"
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", *CACHES, "--instr-atstart=no",
           f"--callgrind-out-file={out_file}", sys.executable, cpu_glue_instructions.__file__, "--worker", mode,
           "--toggle", toggle, "--min-size", str(args.min_size), "--layers", str(args.layers), "--microbatches",
           str(args.microbatches), "--steps", str(args.steps)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0 or not out_file.exists():
        raise SystemExit(f"callgrind run ({mode}) failed:\n{run.stderr[-3000:]}")
    if args.keep_dir:
        Path(args.keep_dir).mkdir(parents=True, exist_ok=True)
        shutil.copy(out_file, Path(args.keep_dir) / out_file.name)
    return read_profile(out_file)


def _row(label: str, values: dict) -> str:
    return (f"  {values['instructions']:>12,.0f} {values['l1d_misses']:>10,.1f} {values['l2_misses']:>10,.1f}  "
            f"{label}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--min-size", type=int, default=512,
                   help="min_offloaded_tensor_size (elements); 512 moves the activations, 2**40 moves nothing")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=1, help="counted steps a mode")
    p.add_argument("--json-out", default=None)
    p.add_argument("--keep-dir", default=None, help="also copy each mode's callgrind output here")
    p.add_argument("--from-dir", default=None,
                   help="read on.callgrind and off.callgrind kept there by --keep-dir instead of running callgrind "
                        "(give the same --layers, --microbatches and --steps)")
    args = p.parse_args(argv)
    if args.from_dir:
        profiles = {mode: read_profile(Path(args.from_dir) / f"{mode}.callgrind") for mode in ("on", "off")}
        return report(profiles, args)
    missing = [t for t in ("valgrind", "cc") if shutil.which(t) is None]
    if missing:
        raise SystemExit(f"cpu_cache_misses.py needs {', '.join(missing)} on PATH: install valgrind and a C compiler")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        toggle = cpu_glue_instructions.build_toggle(workdir)
        profiles = {}
        for mode in ("on", "off"):
            print(f"mode {mode}: counting under callgrind's cache simulator (about ten minutes) ...", flush=True)
            profiles[mode] = run_mode(mode, toggle, args, workdir)
    return report(profiles, args)


def report(profiles: dict, args: argparse.Namespace) -> int:
    """Print (and with ``--json-out`` write) what the ``on`` profile adds over the ``off`` one."""
    layer_mb = args.layers * args.microbatches
    result = summarize(profiles["on"], profiles["off"], layer_mb * args.steps)
    print(f"added by an offloaded step, per layer-microbatch ({layer_mb} a step; simulated L1d 48 KiB, L2 2 MiB):")
    print(f"  {'instructions':>12} {'L1d miss':>10} {'L2 miss':>10}  shared object")
    for name, values in result["added_by_object"].items():
        if any(abs(v) >= 0.5 for v in values.values()):
            print(_row(name, values))
    print("functions adding the most L2 misses:")
    for name, values in result["top_functions_by_l2_misses"].items():
        print(_row(name, values))
    for mode in ("on", "off"):
        print(_row(f"inside our module's calls ({mode}: its code and the calls it makes)",
                   result["inside_our_module"][mode]))
        print(_row(f"  the same without the stub CUDA runtime's copies ({mode})",
                   result["inside_our_module_without_the_stub_copies"][mode]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items() if k not in ("keep_dir", "from_dir")}, "caches": CACHES,
            "per": "layer-microbatch", **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
