"""Where the training thread's CPU time goes, by Python call site, in offloaded steps against plain ones.

Why: in session 36's A runs the offloaded steps' extra time was CPU work (process CPU time +55 ms a step, +33 ms of
it on the main thread, which issues the forward passes), but the runtime's own clock saw about 25 ms in all. What
the rest is (saved-tensor hook machinery inside TE's forward, the optimizer, garbage collection...) is a question of
*where*, which neither the clock nor ``--runtime-breakdown`` (it times our functions only) answers.

``pretrain_gpt.py --sample-stacks HZ``: a ``SIGPROF`` timer (``setitimer(ITIMER_PROF)``, process CPU time) samples
the main thread's Python stack HZ times a CPU second inside each timed step, into one table for offloaded steps
and one for plain steps. Each sample counts once for every distinct function on the stack (inclusive) and once for
the innermost frame's line (self). Time spent in C (a kernel launch, our C++ runtime, PyTorch's hook machinery) is
charged to the Python line that called it. Signals arriving while the main thread is blocked in C (backward runs on
PyTorch's device thread while the main thread waits) are delivered once it returns, several as one, so backward's
CPU shows up under-counted on the line that called ``backward``: read this for the forward and the optimizer.

``report(row)`` turns the JSON's ``stack_samples`` into the frames whose per-step CPU time differs most between the
two kinds of step (ms a step, from the sample counts and the sampling interval). Benchmark tooling only; the handler
costs a few tens of µs a sample, in both kinds of step alike.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections import Counter
from typing import Any

DEPTH = 60  # frames kept from the innermost outward


def _where(code: Any) -> str:
    parts = code.co_filename.replace("\\", "/").split("/")
    return "/".join(parts[-3:]) + ":" + code.co_name


class StackSampler:
    """Samples the main thread's stack on ``SIGPROF`` while a step runs; ``as_dict()`` for the JSON."""

    def __init__(self, hz: float, first_step: int) -> None:
        self.interval = 1.0 / hz
        self.first_step = first_step
        self.tables = {kind: {"steps": 0, "samples": 0, "inclusive": Counter(), "self": Counter()}
                       for kind in ("on", "off")}
        self._table: dict[str, Any] | None = None
        self._step = 0
        self._previous = None

    def install(self) -> None:
        self._previous = signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, self.interval, self.interval)

    def uninstall(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, self._previous or signal.SIG_DFL)

    def start_step(self, on: bool) -> None:
        if self._step >= self.first_step:
            self._table = self.tables["on" if on else "off"]
            self._table["steps"] += 1
        self._step += 1

    def end_step(self) -> None:
        self._table = None

    def _sample(self, signum: int, frame: Any) -> None:
        table = self._table
        if table is None or frame is None:
            return
        table["samples"] += 1
        table["self"][f"{_where(frame.f_code)}:{frame.f_lineno}"] += 1
        seen = set()
        depth = 0
        while frame is not None and depth < DEPTH:
            seen.add(_where(frame.f_code))
            frame = frame.f_back
            depth += 1
        table["inclusive"].update(seen)

    def as_dict(self, top: int = 400) -> dict[str, Any]:
        out: dict[str, Any] = {"interval_s": self.interval, "first_step": self.first_step}
        for kind, t in self.tables.items():
            out[kind] = {"steps": t["steps"], "samples": t["samples"],
                         "inclusive": dict(t["inclusive"].most_common(top)), "self": dict(t["self"].most_common(top))}
        return out


def report(samples: dict[str, Any], rows: int = 40) -> str:
    """The frames whose CPU time a step differs most between offloaded and plain steps (ms a step)."""
    ms = samples["interval_s"] * 1e3
    on, off = samples["on"], samples["off"]
    if not on["steps"] or not off["steps"]:
        return "stack samples: no offloaded or no plain step was sampled"
    lines = [f"samples a step: on {on['samples'] / on['steps']:.0f}, off {off['samples'] / off['steps']:.0f} "
             f"({ms:.2f} ms of process CPU each): on {on['samples'] / on['steps'] * ms:.1f} ms, "
             f"off {off['samples'] / off['steps'] * ms:.1f} ms a step"]
    for kind in ("inclusive", "self"):
        keys = set(on[kind]) | set(off[kind])
        diff = {k: on[kind].get(k, 0) / on["steps"] * ms - off[kind].get(k, 0) / off["steps"] * ms for k in keys}
        lines.append(f"\n{kind}: on - off, ms a step (on / off)")
        for k in sorted(diff, key=lambda k: -abs(diff[k]))[:rows]:
            lines.append(f"{diff[k]:+8.2f}  ({on[kind].get(k, 0) / on['steps'] * ms:7.2f} / "
                         f"{off[kind].get(k, 0) / off['steps'] * ms:7.2f})  {k}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print the stack-sample report of a pretrain_gpt.py JSON")
    p.add_argument("json", help="the run's JSON (--json-out)")
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--rank", type=int, default=0)
    args = p.parse_args(argv)
    row = json.load(open(args.json))["ranks"][args.rank]
    if "stack_samples" not in row:
        print("this run has no stack_samples (run pretrain_gpt.py with --sample-stacks)", file=sys.stderr)
        return 1
    print(report(row["stack_samples"], args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
