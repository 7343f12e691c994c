"""What one shared object's code spends in the others: the calls crossing its boundary, from a callgrind output file.

Why: ``cpu_glue_instructions.py`` splits an offloaded step's added instructions by shared object, self cost only. It
says the interpreter runs about half of them, not which of our C++ functions make it run them. Callgrind records,
for every call site, the callee's inclusive cost; summing those of the calls that leave our module (its functions
calling into libpython, libc10, the stub CUDA runtime, ...) gives what each of our functions costs in the other
objects, and which of their functions it pays for. Session 47 used it to find the summary's Python-int clock
(``add_runtime``, about 800 instructions a hook call) and the hook objects' construction through a Python type call.

    python benchmarks/callgrind_boundary.py ON.callgrind [--object mcore_offload_hooks] [--top 30] [--json-out F]

Read it with the step's layer-microbatches in mind (``cpu_glue_instructions.py --keep-dir`` keeps the files: one
counted step, 128 layer-microbatches by default). A call back into our module from inside the other object (a
Python method that calls our C++) is counted in the outer call's cost; the runtime makes few of those (session 45).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

_COMPRESSED = re.compile(r"\((\d+)\)(?:\s+(.*))?$")


class _Names:
    """Callgrind's name compression: ``(id) name`` defines an id, ``(id)`` reuses it (per kind: ob, fl, fn)."""

    def __init__(self) -> None:
        self.by_kind: dict[str, dict[str, str]] = {"ob": {}, "fl": {}, "fn": {}}

    def read(self, kind: str, value: str) -> str:
        m = _COMPRESSED.match(value.strip())
        if m is None:
            return value.strip()
        table = self.by_kind[kind]
        if m.group(2) is not None:
            table[m.group(1)] = m.group(2)
        return table.get(m.group(1), value.strip())


class Position:
    """Where a callgrind file's reader stands: the current object and function, and the callee named for the next
    ``calls=`` line (its object ``cob``: None for the caller's own). ``read`` takes one ``key=value`` line and says
    whether it was a naming line."""

    def __init__(self) -> None:
        self.names = _Names()
        self.ob: str | None = None
        self.fn: str | None = None
        self.cob: str | None = None
        self.cfn: str | None = None

    def read(self, key: str, value: str) -> bool:
        if key == "ob":
            self.ob = self.names.read("ob", value)
        elif key == "fn":
            self.fn, self.cob = self.names.read("fn", value), None
        elif key == "cob":
            self.cob = self.names.read("ob", value)
        elif key == "cfn":
            self.cfn = self.names.read("fn", value)
        elif key in ("fl", "fi", "fe", "cfi", "cfl"):
            self.names.read("fl", value)
        else:
            return False
        return True

    def callee_object(self) -> str | None:
        return self.cob if self.cob is not None else self.ob


def boundary_calls(path: Path, obj: str) -> dict[str, collections.Counter]:
    """Inclusive instructions of the calls from functions of objects matching ``obj`` into any other object:
    ``by_object`` (callee object), ``by_caller`` ((caller function, callee object)), ``by_callee`` ((callee object,
    callee function)) and ``calls`` (the same keys as ``by_callee``, call counts)."""
    pos = Position()
    pending_calls: int | None = None
    out = {k: collections.Counter() for k in ("by_object", "by_caller", "by_callee", "calls")}
    with open(path, errors="replace") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if pending_calls is not None:  # the line after calls=: the call site and the callee's inclusive cost
                parts = line.split()
                cost = int(parts[1]) if len(parts) > 1 else 0
                callee_ob = pos.callee_object()
                if pos.ob is not None and obj in pos.ob and callee_ob is not None and obj not in callee_ob:
                    callee = Path(callee_ob).name
                    out["by_object"][callee] += cost
                    out["by_caller"][(pos.fn, callee)] += cost
                    out["by_callee"][(callee, pos.cfn)] += cost
                    out["calls"][(callee, pos.cfn)] += pending_calls
                pending_calls, pos.cob = None, None
                continue
            key, _, value = line.partition("=")
            if not pos.read(key, value) and key == "calls":
                pending_calls = int(value.split()[0])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("callgrind_file")
    p.add_argument("--object", default="mcore_offload_hooks", help="the object whose outgoing calls count (substring)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    res = boundary_calls(Path(args.callgrind_file), args.object)
    total = sum(res["by_object"].values())
    print(f"calls from {args.object} into other objects: {total:,} instructions (inclusive)")
    for name, c in res["by_object"].most_common():
        print(f"  {c:>14,}  {name}")
    print(f"\nby caller (top {args.top}):")
    for (caller, callee), c in res["by_caller"].most_common(args.top):
        print(f"  {c:>14,}  {callee:28.28}  {caller}")
    print(f"\nby callee (top {args.top}):")
    for key, c in res["by_callee"].most_common(args.top):
        print(f"  {c:>14,}  {res['calls'][key]:>8} calls  {key[0]:28.28}  {key[1]}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "file": args.callgrind_file, "object": args.object, "total": total,
            "by_object": dict(res["by_object"].most_common()),
            "by_caller": [[caller, callee, c] for (caller, callee), c in res["by_caller"].most_common(args.top)],
            "by_callee": [[callee, fn, c, res["calls"][(callee, fn)]]
                          for (callee, fn), c in res["by_callee"].most_common(args.top)],
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
