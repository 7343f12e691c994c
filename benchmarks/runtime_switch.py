"""Two settings of our runtime timed in one process: ``pretrain_gpt.py --alternate-runtime KEY=VALUE ...``.

Every step offloads; the even steps run with the given settings, the odd ones with the runtime's own (from the
environment or its defaults), so the paired overhead of ``paired_steps.py`` is the given settings' cost over the
defaults (negative: they are faster) under the same host drift, and the Δpeak is the defaults' peak less theirs.
Separate processes on the GPU host differ by more than the few percent such a change is worth (session 23: two
runs of one command read +6.0 and +11.5 % on one rank), so a setting is judged this way, not from two runs.

Only settings the runtime reads afresh at every use, and that no state carries from one step to the next, can be
switched between steps: the layers per copy-out burst (``flush_layers``, ``MCORE_OFFLOAD_FLUSH_LAYERS``) and per
reload burst (``reload_layers``, ``MCORE_OFFLOAD_RELOAD_LAYERS``), and when backward reloads the layer below
(``prefetch``, ``MCORE_OFFLOAD_PREFETCH``: ``layer``, ``tail`` or ``late``; Δpeak against reload stall), whether a
chain's first point reloads in a part of its own (``split_chains``, ``MCORE_OFFLOAD_SPLIT_CHAINS``: ``1`` or ``0``),
and whether
the offload points' forward glue is the C++ one (``native_points``, ``on`` or ``off``; ``MCORE_OFFLOAD_NATIVE_POINTS``:
each step's hooks are registered and run within it), and how many copy-out bursts may be in flight
(``d2h_in_flight``, ``MCORE_OFFLOAD_D2H_IN_FLIGHT``: ``0`` for no bound; the transports read it at every burst, and a
step's end leaves none in flight either way), what a chunk's forward end does with the copy-out bursts still running
(``forward_end``, ``MCORE_OFFLOAD_FORWARD_END``: ``hand-over`` or ``wait``; read at each forward end), and whether a
SequentialMLP's experts share one group per layer
(``expert_loop``, ``MCORE_OFFLOAD_EXPERT_LOOP``: ``1`` or ``0``; read at each loop's entry). Benchmark tooling only:
the library never imports it.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

#: settings that may change between steps (each the OffloadManager attribute it sets), and their values: None for a
#: positive whole number of layers, else the words allowed
SWITCHABLE: dict[str, tuple[str, ...] | None] = {"flush_layers": None, "reload_layers": None,
                                                 "prefetch": ("layer", "tail", "late"), "native_points": ("on", "off"),
                                                 "split_chains": ("1", "0"), "d2h_in_flight": ("0", "1", "2", "4"),
                                                 "expert_loop": ("1", "0"), "forward_end": ("hand-over", "wait")}


def _get(manager: Any, key: str) -> int | str:
    """The manager's setting ``key`` in this module's words (``native_points`` holds the C++ module or None)."""
    if key == "d2h_in_flight":
        from mcore_offload.runtime.transport import d2h_in_flight_from_env, live_transports

        made = live_transports()
        return str(made[0].d2h_in_flight if made else d2h_in_flight_from_env())
    if key == "forward_end":
        from mcore_offload.runtime.transport import forward_end_from_env, live_transports

        made = live_transports()
        return ("wait" if made[0].wait_at_forward_end else "hand-over") if made else forward_end_from_env()
    value = getattr(manager, key)
    if key in ("split_chains", "expert_loop"):
        return "1" if value else "0"
    return ("on" if value is not None else "off") if key == "native_points" else value


def _set(manager: Any, key: str, value: int | str) -> None:
    if key == "d2h_in_flight":
        # the transports made so far, and (through the variable they read when made) any made later
        from mcore_offload.runtime.transport import D2H_IN_FLIGHT_VARIABLE, live_transports

        os.environ[D2H_IN_FLIGHT_VARIABLE] = str(value)
        for t in live_transports():
            t.d2h_in_flight = int(value)
        return
    if key == "forward_end":
        from mcore_offload.runtime.transport import FORWARD_END_VARIABLE, live_transports

        os.environ[FORWARD_END_VARIABLE] = str(value)
        for t in live_transports():
            t.wait_at_forward_end = value == "wait"
        return
    if key == "native_points":
        if value == "on" and manager.native is None:
            raise SystemExit("--alternate-runtime native_points=on needs the C++ hooks: they did not load here "
                             "(MCORE_OFFLOAD_NATIVE)")
        setattr(manager, key, manager.native if value == "on" else None)
    elif key in ("split_chains", "expert_loop"):
        setattr(manager, key, value == "1")
    else:
        setattr(manager, key, value)


def parse_settings(items: list[str]) -> dict[str, int | str]:
    """``["flush_layers=4", "prefetch=late"]`` -> ``{"flush_layers": 4, "prefetch": "late"}``; a bad item raises
    ValueError with one sentence saying what to write instead."""
    out: dict[str, int | str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in SWITCHABLE:
            raise ValueError(f"--alternate-runtime takes KEY=VALUE with KEY one of {', '.join(SWITCHABLE)}; "
                             f"got {item!r}")
        words = SWITCHABLE[key]
        if words is None and (not value.isdigit() or int(value) < 1):
            raise ValueError(f"--alternate-runtime {key} must be a positive whole number of layers; got {value!r}")
        if words is not None and value not in words:
            raise ValueError(f"--alternate-runtime {key} must be one of {', '.join(words)}; got {value!r}")
        if key in out:
            raise ValueError(f"--alternate-runtime sets {key} twice; give each setting once")
        out[key] = int(value) if words is None else value
    if not out:
        raise ValueError("--alternate-runtime needs at least one KEY=VALUE")
    return out


class RuntimeSwitch:
    """Puts ``settings`` on the runtime's manager in the steps under test and its own values back in the others;
    records what the manager held at each step's end (the check that nothing reset them mid-step)."""

    def __init__(self, settings: dict[str, int | str]) -> None:
        self.settings = dict(settings)
        self.defaults: dict[str, int | str] | None = None
        self.held: list[dict[str, int | str]] = []

    @staticmethod
    def _manager() -> Any:
        from mcore_offload.runtime.manager import get_manager

        return get_manager()

    def start_step(self, under_test: bool) -> None:
        manager = self._manager()
        if self.defaults is None:
            self.defaults = {key: _get(manager, key) for key in self.settings}
            # the defaults' side must stay the defaults: the runtime's own choice of copy-out settings
            # (runtime/host_ahead.py) would change them mid-run
            if manager.host_ahead.state in ("probing", "watching"):
                manager.host_ahead.state = "off"
        for key, value in (self.settings if under_test else self.defaults).items():
            _set(manager, key, value)

    def end_step(self) -> None:
        manager = self._manager()
        self.held.append({key: _get(manager, key) for key in self.settings})

    def as_dict(self, per_step: dict[str, list], under_test: list[bool], first: int) -> dict[str, Any]:
        """What was switched, what each step held, and from step ``first`` on the medians of the runtime's per-step
        series (``OffloadSummary.link_series``: every step offloads here, so its index is the step's) under the
        settings (``test``) and under the defaults."""
        medians: dict[str, dict[str, float | None]] = {}
        for key in ("runtime_cpu_ms", "stall_ms", "d2h_GBps", "h2d_GBps"):
            series = per_step.get(key, [])
            for side, want in (("test", True), ("default", False)):
                vals = [v for i, (v, t) in enumerate(zip(series, under_test)) if i >= first and t is want
                        and v is not None]
                medians.setdefault(key, {})[side] = statistics.median(vals) if vals else None
        return {"settings": self.settings, "defaults": self.defaults, "held_per_step": self.held,
                "medians": medians}
