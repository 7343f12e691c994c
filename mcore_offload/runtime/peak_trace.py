"""The peak a step would have reached without offloading, interval by interval: what ``auto``'s plan is chosen for.

Why a trace of its own: the probe offloads every group, and that moves the step's peak. On D-moe's first pipeline
rank the probe peaked at 4.02 GiB with one late layer's groups off the device, while the plain step peaks at 6.10 GiB
at another moment; the plan took that layer and freed nothing (session 69). B's probe peaked in the backward with
nothing off at all (sessions 7 and 68).

What is traced: without offloading, every offloaded storage would still be on the device, so at any moment the plain
step holds what is allocated plus what is off the device. The bytes off the device change only at our own release and
reload events; between two of them they are constant, so the allocator's peak within the interval (read and reset at
each event) plus those bytes is the plain step's peak over that interval. The largest is the plain step's peak. The
groups off the device there are what a plan can take off it, and once it takes them the peak can move to another
interval, which is why the intervals are kept. Not all of them: no plan takes the step below the allocator's own
peak with everything offloaded, so an interval under that floor can never be the peak and is dropped (on a large
model the peak step has thousands of intervals, each with its bytes per layer and point).

The estimate assumes the plain step allocates as the probe did; a storage the probe released early is counted as held
until its reload, which is when the plain step would still hold it at the latest.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field


@dataclass
class PeakTrace:
    """Per interval between two release / reload events of the traced step: the plain step's peak in it, and the bytes
    off the device then per key (``(vp_stage, layer, point)`` as traced, or any key after :meth:`regroup`)."""

    plain: list[int] = field(default_factory=list)
    off: list[dict[Hashable, int]] = field(default_factory=list)
    floor: int = 0  # the allocator's highest interval peak so far: no plan goes below it
    _kept_at_compaction: int = 0

    def add(self, allocator_peak: int, off_device_bytes: int, off_by_key: dict[Hashable, int] | None) -> None:
        """Close one interval: the allocator's peak in it and the bytes off the device during it."""
        self.floor = max(self.floor, allocator_peak)
        plain = allocator_peak + off_device_bytes
        if plain < self.floor:
            return
        self.plain.append(plain)
        self.off.append({k: v for k, v in off_by_key.items() if v > 0} if off_by_key else {})
        if len(self.plain) > 2 * self._kept_at_compaction + 64:
            self.compact()

    def compact(self) -> None:
        """Drop the intervals that the floor has risen above since they were kept."""
        kept = [i for i, p in enumerate(self.plain) if p >= self.floor]
        self.plain = [self.plain[i] for i in kept]
        self.off = [self.off[i] for i in kept]
        self._kept_at_compaction = len(kept)

    def __len__(self) -> int:
        return len(self.plain)

    @property
    def plain_peak(self) -> int:
        return max(self.plain, default=0)

    def regroup(self, key: Callable[[Hashable], Hashable | None]) -> PeakTrace:
        """The same trace with each key mapped by ``key`` (bytes of keys that map together are summed; a key mapped
        to None is dropped from the per-key bytes, not from ``plain``)."""
        out = PeakTrace(list(self.plain), [], self.floor)
        for off in self.off:
            merged: dict[Hashable, int] = {}
            for k, v in off.items():
                new = key(k)
                if new is not None:
                    merged[new] = merged.get(new, 0) + v
            out.off.append(merged)
        return out

    def residual(self, taken: Iterable[Hashable]) -> list[int]:
        """Each interval's peak once the keys ``taken`` are offloaded."""
        taken = set(taken)
        return [p - sum(v for k, v in off.items() if k in taken) for p, off in zip(self.plain, self.off)]

    def peak_after(self, taken: Iterable[Hashable]) -> int:
        return max(self.residual(taken), default=0)

    def saving(self, taken: Iterable[Hashable]) -> int:
        """What offloading the keys ``taken`` takes off the plain step's peak."""
        return self.plain_peak - self.peak_after(taken)

    def keys(self) -> set[Hashable]:
        """Every key that was off the device in some interval."""
        return {k for off in self.off for k in off}


class PeakFollower:
    """A plan's picks, one at a time, against a :class:`PeakTrace`: each pick lowers the intervals where its key was
    off; :meth:`at_peak` gives a key's bytes in the interval that is now the highest."""

    def __init__(self, trace: PeakTrace) -> None:
        self.trace = trace
        self._residual = list(trace.plain)
        self._top = self._argmax()

    def _argmax(self) -> int | None:
        if not self._residual:
            return None
        return max(range(len(self._residual)), key=self._residual.__getitem__)

    def at_peak(self, key: Hashable) -> int:
        return 0 if self._top is None else self.trace.off[self._top].get(key, 0)

    def take(self, key: Hashable) -> None:
        for i, off in enumerate(self.trace.off):
            nbytes = off.get(key)
            if nbytes:
                self._residual[i] -= nbytes
        self._top = self._argmax()
