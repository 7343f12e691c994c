"""Step-time overhead from one process that alternates offloaded and plain steps (``--alternate-offload``).

Separate runs on a noisy host differ by more than the few percent to be resolved (the GPU host moved one
baseline's median by 25 % between runs a minute apart). Alternating steps in one process exposes both kinds
to the same drift; each offloaded step is compared with the mean of its plain neighbours (before and after),
which cancels drift that is linear over three steps. The overhead is the median of those ratios, with a
bootstrap 95 % interval over the ratios.

With one offloaded step in two (``--alternate-period 2``, the default) the offloaded steps are always the even ones,
so an effect of a step's parity on its time (work the schedule does every other step) would bias every ratio the same
way. With one in three (``--alternate-period 3``) offloaded steps fall on even and odd steps in turn: each value is
then the geometric mean of two consecutive ratios of opposite parity, where such an effect cancels, and the plain
steps, which come in adjacent twos, measure the effect itself (:func:`plain_step_effects`). They also measure work
an offloaded step leaves to the step after it, which either period's overhead leaves out (that step is a plain
neighbour of its ratio).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable

#: a resampler: ``list`` (the samples as they are) or one bootstrap draw
Resample = Callable[[list[float]], list[float]]


def first_counted_step(warmup_steps: int, period: int = 2, block: int | None = None) -> int:
    """The first step an alternating run counts: the plain one at or after the warm-up just before an offloaded step
    (step ``s`` is offloaded when ``s % period == 0``), so that the next offloaded step has plain neighbours on both
    sides; with ``--alternate-block`` (``block``), the warm-up's end, where the first plain block starts
    (``pretrain_gpt.py`` writes it; ``overhead_ratio.py`` reads the runs back with it)."""
    if block:
        return warmup_steps
    step = warmup_steps
    while (step + 1) % period:
        step += 1
    return step


def paired_ratios(step_ms: list[float], on_steps: list[bool], first: int = 0,
                  over: list[float | None] | None = None) -> list[float]:
    """For every offloaded step ``i`` with plain steps ``i - 1 >= first`` and ``i + 1``: ``t[i] / mean(both)``.

    Steps with one plain neighbour only are left out: a one-sided ratio keeps the drift. ``over``: per-step values to
    divide instead of the step times (``runtime_clock_share.py``: the runtime's clock), None where a step has none.
    """
    top = step_ms if over is None else over
    ratios = []
    for i in range(max(first + 1, 1), len(step_ms) - 1):
        if on_steps[i] and not on_steps[i - 1] and not on_steps[i + 1] and top[i] is not None:
            ratios.append(top[i] / (0.5 * (step_ms[i - 1] + step_ms[i + 1])))
    return ratios


def _opposite_parity_means(indexed: list[tuple[int, float]]) -> list[float]:
    """Geometric means of consecutive, non-overlapping twos of ``(step, value)`` whose steps differ in parity (an
    irregular pattern's two of one parity moves on by one)."""
    out, k = [], 0
    while k + 1 < len(indexed):
        (i, a), (j, b) = indexed[k], indexed[k + 1]
        if i % 2 != j % 2:
            out.append(math.sqrt(a * b))
            k += 2
        else:
            k += 1
    return out


def pair_values(step_ms: list[float], on_steps: list[bool], first: int = 0) -> list[float]:
    """The values an alternating run's overhead is the median of: :func:`paired_ratios` where every offloaded step
    has one parity (period 2); where they alternate between parities (period 3), the geometric mean of each
    consecutive, non-overlapping two of opposite parity, so that a parity effect cancels inside every value."""
    indexed = []
    for i in range(max(first + 1, 1), len(step_ms) - 1):
        if on_steps[i] and not on_steps[i - 1] and not on_steps[i + 1]:
            indexed.append((i, step_ms[i] / (0.5 * (step_ms[i - 1] + step_ms[i + 1]))))
    if len({i % 2 for i, _ in indexed}) < 2:
        return [r for _, r in indexed]
    return _opposite_parity_means(indexed)


def block_on_steps(n: int, warmup_steps: int, block: int) -> list[bool]:
    """``--alternate-block B``: which of ``n`` steps offload. From the warm-up's end, B plain steps, B offloaded ones,
    and so on (the steps before follow the same pattern backwards)."""
    return [((step - warmup_steps) // block) % 2 == 1 for step in range(n)]


def block_values(step_ms: list[float], on_steps: list[bool], first: int = 0, skip: int = 1) -> list[float]:
    """The values a block-alternating run's overhead is the median of: for every block of offloaded steps with a
    plain block on each side (the run's last may be cut short), its steps' median over the mean of the two plain
    blocks' medians. The first
    ``skip`` steps of every block are left out: a switch's own cost (native's set-up when it resumes, work an
    offloaded step leaves to the next) lands there, where a step-by-step alternation books it as overhead or saving.

    Why blocks: the 2x H200 host has slow periods of 10-40 steps (session 27); a window run's phases can fall in
    different ones, while neighbouring blocks of a few steps mostly share one.
    """
    blocks: list[tuple[bool, list[float]]] = []  # (offloaded, counted step times) of each run of steps from ``first``
    i = first
    while i < len(step_ms):
        j = i
        while j < len(step_ms) and on_steps[j] == on_steps[i]:
            j += 1
        blocks.append((on_steps[i], step_ms[i + skip:j]))  # the last may be cut short: fewer steps, still counted
        i = j
    if blocks and blocks[0][0]:  # the counted steps must start with a plain block
        blocks = blocks[1:]
    out = []
    for k in range(1, len(blocks) - 1):
        (before_on, before), (on, mid), (after_on, after) = blocks[k - 1], blocks[k], blocks[k + 1]
        if on and not before_on and not after_on and before and mid and after:
            plain = 0.5 * (statistics.median(before) + statistics.median(after))
            out.append(statistics.median(mid) / plain)
    return out


def alternation_values(step_ms: list[float], on_steps: list[bool], first: int, block: int | None = None) -> list[float]:
    """The values an alternating run's overhead is the median of: :func:`block_values` for a block-alternating run
    (``block``), else :func:`pair_values`."""
    return block_values(step_ms, on_steps, first) if block else pair_values(step_ms, on_steps, first)


def plain_step_effects(step_ms: list[float], on_steps: list[bool], first: int = 0) -> dict | None:
    """What the adjacent twos of plain steps between offloaded ones show (``--alternate-period 3``): the even step's
    time over the odd one's (a parity effect, which period 2 cannot see and books as overhead or saving), and the
    first plain step's over the second's (work an offloaded step leaves to the step after it, which period 2 books
    as a saving). In every other two the even step comes first, so each effect is taken over consecutive twos of
    opposite order, where the other one cancels. Medians in %, with bootstrap 95 % intervals; None without such
    twos of both orders."""
    parity, after = [], []
    for i in range(max(first, 1), len(step_ms) - 1):
        if on_steps[i - 1] and not on_steps[i] and not on_steps[i + 1]:
            even, odd = (i, i + 1) if i % 2 == 0 else (i + 1, i)
            parity.append((i, step_ms[even] / step_ms[odd]))
            after.append((i, step_ms[i] / step_ms[i + 1]))
    parity, after = _opposite_parity_means(parity), _opposite_parity_means(after)
    if not parity:
        return None
    out: dict = {"plain_twos": 2 * len(parity)}
    for key, vals in (("even_over_odd_pct", parity), ("after_offloaded_pct", after)):
        lo, hi = bootstrap_median_interval(vals)
        out[key] = round(100 * (statistics.median(vals) - 1), 2)
        out[key.replace("_pct", "_ci95_pct")] = [round(100 * (lo - 1), 2), round(100 * (hi - 1), 2)]
    return out


def bootstrap_median_interval(values: list[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the median over ``rounds`` resamples (fixed seed: reproducible)."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[min(int(0.975 * rounds), rounds - 1)]


def bootstrap_ratio(ours: Callable[[Resample], float], native: Callable[[Resample], float],
                    describe: Callable[[float], str], rounds: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """Ours' overhead over native's with a bootstrap 95 % interval: ``(ratio, low, high)``. ``ours`` and ``native``
    compute a side's overhead from its samples passed through a resampler (``list`` for the point estimate, a draw with
    replacement in each round); ``describe`` words native's overhead in the error where it is not positive.

    Rounds where native's resampled overhead is not positive have no ratio and are dropped (an error where over 5 %
    are): a ratio to an overhead that may be nothing means nothing.
    """
    base = native(list)
    if base <= 0:
        raise ValueError(f"native's {describe(base)}: a ratio to it means nothing")
    rng = random.Random(seed)

    def draw(values: list[float]) -> list[float]:
        return rng.choices(values, k=len(values))

    ratios = []
    for _ in range(rounds):
        n = native(draw)
        if n > 0:
            ratios.append(ours(draw) / n)
    if len(ratios) < 0.95 * rounds:
        raise ValueError("native's overhead is not clearly positive: over 5 % of the resamples put it at or under 0")
    ratios.sort()
    k = len(ratios)
    return ours(list) / base, ratios[int(0.025 * k)], ratios[min(int(0.975 * k), k - 1)]


def overhead_ratio_interval(ours: list[float], native: list[float], rounds: int = 2000,
                            seed: int = 0) -> tuple[float, float, float]:
    """Ours' paired overhead over native's (each the median of its per-pair ratios less 1), with a bootstrap 95 %
    interval: ``(ratio, low, high)``. The two runs are separate processes, so each list is resampled on its own.

    Why: "at most a third of native's overhead" is a statement about this ratio. Comparing ours' interval's upper
    bound with a third of native's lower bound asks more than that (both extremes at once) and leaves most runs
    unresolved on a noisy host; this interval is of the ratio itself (:func:`bootstrap_ratio`).
    """
    if not ours or not native:
        raise ValueError("both runs need at least one offloaded step with plain neighbours (alternation pairs)")
    return bootstrap_ratio(lambda pick: statistics.median(pick(ours)) - 1,
                           lambda pick: statistics.median(pick(native)) - 1,
                           lambda base: f"paired overhead is {100 * base:+.2f} %", rounds, seed)


def _split_medians(values: list[float], on_steps: list[bool], first: int) -> tuple[float | None, float | None]:
    """Medians of ``values`` over the counted offloaded steps and over the counted plain ones."""
    on = [t for t, o in zip(values[first:], on_steps[first:]) if o]
    off = [t for t, o in zip(values[first:], on_steps[first:]) if not o]
    return (statistics.median(on) if on else None), (statistics.median(off) if off else None)


def alternation_summary(step_ms: list[float], on_steps: list[bool], first: int,
                        peaks: list[int] | None = None, issue_ms: list[float] | None = None,
                        block: int | None = None) -> dict:
    """What the JSON row of an alternating run reports (percentages, rounded). ``issue_ms``: the host time each
    step took to issue its work (``pretrain_gpt.py``), reported as on / off medians too. ``block``: the run
    alternated blocks of that many steps (:func:`block_values`; ``pairs`` then counts offloaded blocks)."""
    ratios = alternation_values(step_ms, on_steps, first, block)
    on, off = _split_medians(step_ms, on_steps, first)
    out: dict = {"pairs": len(ratios), "step_ms_on_median": on, "step_ms_off_median": off}
    if block:
        out["block"] = block
    if issue_ms is not None:
        out["issue_ms_on_median"], out["issue_ms_off_median"] = _split_medians(issue_ms, on_steps, first)
    if ratios:
        lo, hi = bootstrap_median_interval(ratios)
        out["paired_overhead_pct"] = round(100 * (statistics.median(ratios) - 1), 2)
        out["paired_overhead_ci95_pct"] = [round(100 * (lo - 1), 2), round(100 * (hi - 1), 2)]
    if peaks is not None:
        p_on = [p for p, o in zip(peaks[first:], on_steps[first:]) if o]
        p_off = [p for p, o in zip(peaks[first:], on_steps[first:]) if not o]
        if p_on and p_off:
            out["peak_bytes_on_max"], out["peak_bytes_off_max"] = max(p_on), max(p_off)
            out["delta_peak_bytes"] = max(p_off) - max(p_on)
    effects = None if block else plain_step_effects(step_ms, on_steps, first)
    if effects is not None:
        out["plain_steps"] = effects
    return out
