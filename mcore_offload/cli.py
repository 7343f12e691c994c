"""``mcore-offload`` command line: ``mcore-offload patch {apply,check,revert,status} [--megatron-path DIR]`` and
``mcore-offload plan ...`` (project an offloaded run's per-rank peak memory before launching it),
``mcore-offload measure`` (this machine's host link and GEMM rate, for ``plan --hardware-json``) and
``mcore-offload build-native`` (compile the C++ saved-tensor hooks ahead of a run)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from mcore_offload.patching import tooling
from mcore_offload.plan.cli import add_plan_parser


def _patch(args: argparse.Namespace) -> int:
    install = tooling.find_megatron(args.megatron_path)
    where = f"megatron-core {install.version} at {install.core}"
    source = tooling.patch_source(install.version)
    if source != install.version:
        where += f" (taking {source}'s patches: the files they touch are identical)"
    if args.action == "apply":
        done = tooling.apply_patches(install)
        print(f"{where}: applied {', '.join(done)}" if done else f"{where}: already patched, nothing to do")
        return 0
    if args.action == "revert":
        done = tooling.revert_patches(install)
        print(f"{where}: reverted {', '.join(done)}" if done else f"{where}: not patched, nothing to do")
        return 0
    states = tooling.check_patches(install)
    print(where)
    for name, state in states.items():
        print(f"  {name}: {state.value}")
    if args.action == "status":
        return 0
    return 1 if any(s is tooling.PatchState.CONFLICT for s in states.values()) else 0


def _build_native(args: argparse.Namespace) -> int:
    from mcore_offload.runtime import native

    try:
        module = native.build(verbose=args.verbose)
    except Exception as exc:  # the builder raises compiler, ninja and import errors alike
        print(f"mcore-offload: the C++ saved-tensor hooks did not build ({exc}); runs will use the Python hooks, "
              "or install a C++ compiler and ninja and try again", file=sys.stderr)
        return 2
    print(f"C++ saved-tensor hooks ready: {module.__file__}")
    return 0


def _measure(args: argparse.Namespace) -> int:
    from mcore_offload.plan.measure import format_measured, measure
    from mcore_offload.plan.model import PlanError

    try:
        measured = measure(args.copy_mib, args.iters, args.gemm_size, args.device, args.all_gpus)
    except PlanError as exc:
        print(f"mcore-offload measure: {exc}", file=sys.stderr)
        return 2
    print(format_measured(measured), end="")
    if args.json_out is None:
        print("add --json-out PATH to plan with these rates: mcore-offload plan --hardware-json PATH ...")
        return 0
    try:
        with open(args.json_out, "w") as f:
            json.dump(measured.to_json(), f, indent=2)
    except OSError as exc:
        print(f"mcore-offload measure: cannot write {args.json_out} ({exc.strerror}); pass a writable --json-out "
              "path.", file=sys.stderr)
        return 1
    print(f"wrote {args.json_out}; plan with it: mcore-offload plan --hardware-json {args.json_out} ...")
    return 0


def build_parser() -> argparse.ArgumentParser:
    # the module docstring is reST for the docs; the help shows plain words
    parser = argparse.ArgumentParser(
        prog="mcore-offload",
        description="Fine-grained activation offloading for megatron-core: patch an install, project a run's "
                    "per-rank peak memory before launching it, measure this machine's host link and GEMM rate, "
                    "or build the C++ hooks ahead of a run.")
    sub = parser.add_subparsers(dest="command", required=True)
    patch = sub.add_parser("patch", help="apply, check, revert or show our megatron-core patches")
    patch.add_argument("action", choices=["apply", "check", "revert", "status"])
    patch.add_argument("--megatron-path", default=None,
                       help="directory holding megatron/core (default: the installed megatron-core)")
    patch.set_defaults(func=_patch)
    add_plan_parser(sub)
    meas = sub.add_parser("measure", help="time this GPU's pinned host copies and bf16 GEMM for plan --hardware-json")
    meas.add_argument("--json-out", metavar="PATH", default=None, help="write the rates for plan --hardware-json")
    meas.add_argument("--copy-mib", type=int, default=256, help="bytes of each pinned copy, MiB (default 256)")
    meas.add_argument("--iters", type=int, default=20, help="timed copies and GEMMs of each kind (default 20)")
    meas.add_argument("--gemm-size", type=int, default=8192, help="n of the n x n x n bf16 GEMM (default 8192)")
    meas.add_argument("--device", type=int, default=None, help="CUDA device index (default the current one)")
    meas.add_argument("--all-gpus", action="store_true",
                      help="time every visible GPU's copies at once, as a training job's ranks copy, and keep each "
                           "rate's lowest (4 pinned host buffers of --copy-mib per GPU)")
    meas.set_defaults(func=_measure)
    build = sub.add_parser("build-native", help="compile the C++ saved-tensor hooks now (runs build them on first use)")
    build.add_argument("--verbose", action="store_true", help="show the compiler's output")
    build.set_defaults(func=_build_native)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if args.command != "plan":
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if not args.ignore_unknown_args:
            parser.error(f"plan: unrecognized arguments: {' '.join(unknown)}; the planner reads model, layout and "
                         "training flags only: drop the others, or add --ignore-unknown-args to plan from a whole "
                         "Megatron-LM command line.")
        args.ignored_args = unknown
    try:
        return args.func(args)
    except tooling.PatchError as exc:
        print(f"mcore-offload: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
