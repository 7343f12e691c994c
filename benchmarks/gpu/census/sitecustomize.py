"""GPU diagnostic: count the storages each offload point copies out, by size, in every process of a run.

Put this folder first on ``PYTHONPATH`` with ``MCO_CENSUS_OUT=DIR`` set, and run ``benchmarks/pretrain_gpt.py`` with
``--audit-offloaded`` (the audit makes the flush report each copied storage to ``OffloadManager.on_offloaded``,
which this wraps; the C++ copy-out reports a burst's totals only). Each rank writes ``DIR/census-rank<R>.json``
at exit: the schedule calls seen and, per (point, bytes), how many storages were copied. Why: every storage costs
a copy call, a host buffer, an entry and a reload copy, so how many there are per layer, and how small, decides
what a burst costs on the host.

    source .gpu/w/setup.sh 0.15.3; export PYTHONPATH=$PWD/benchmarks/gpu/census:$PYTHONPATH MCO_CENSUS_OUT=$OUT/c
    CONFIG=C VARIANTS=all5 EXTRA=--audit-offloaded ITERS=8 bash benchmarks/gpu/issue5_host.sh /tmp/r/census

Benchmark tooling only: the library never imports it.
"""

import os

if os.environ.get("MCO_CENSUS_OUT"):
    import atexit
    import collections
    import json
    import pathlib

    def _install() -> None:
        try:
            from mcore_offload.runtime import manager
        except ImportError:  # a process without the project on its path (the launcher's helpers)
            return
        counts: collections.Counter = collections.Counter()
        steps = [0]
        on_offloaded, end_step = manager.OffloadManager.on_offloaded, manager.OffloadManager.end_step

        def counted(self, entry):
            counts[(entry.point, int(entry.nbytes))] += 1
            return on_offloaded(self, entry)

        def ended(self, aborted=False):
            steps[0] += 1
            return end_step(self, aborted)

        manager.OffloadManager.on_offloaded, manager.OffloadManager.end_step = counted, ended

        def write() -> None:
            if not counts:
                return
            out = pathlib.Path(os.environ["MCO_CENSUS_OUT"])
            out.mkdir(parents=True, exist_ok=True)
            rows = [[p, n, c] for (p, n), c in sorted(counts.items())]
            (out / f"census-rank{os.environ.get('RANK', '0')}.json").write_text(
                json.dumps({"schedule_calls": steps[0], "storages": rows}, indent=1))

        atexit.register(write)

    _install()
