"""One reload copy per group instead of one per storage (``MCORE_OFFLOAD_COALESCE_RELOADS=1``, opt-in).

In a launch-bound step every CUDA call costs 10-20 µs of host time (session 21: a copy burst's Python is 6-10 µs, its
CUDA calls about 110-140 µs). A group's storages are reloaded with one copy if they lie back to back in host memory
and come back into one device block: the copy-out gives a burst's storages consecutive, aligned slices of one host
buffer, and the reload makes each group's storages regions of one block (``runtime/native/copy_calls.cpp``
``region_storages``, each region keeping the block alive). :class:`CoalescedReloads` adds this to the raw transport.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_offload.config import choice_env

#: alignment of the slices of a coalesced host buffer (the caching allocator's block alignment: kernels see reloaded
#: storages at addresses as aligned as the originals)
COALESCE_ALIGN = 512


def slice_span(nbytes: int) -> int:
    """The room a storage of ``nbytes`` takes in a coalesced host buffer: the copy-out lays slices out with it and the
    reload finds runs of consecutive slices with it, so both sides must use this one rule."""
    return -(-nbytes // COALESCE_ALIGN) * COALESCE_ALIGN


def coalesce_reloads() -> bool:
    """``MCORE_OFFLOAD_COALESCE_RELOADS=1``: one host buffer per copy-out burst and one reload copy per group
    (:meth:`RawCudaTransport._coalesced_layout`); default 0 (one buffer and one copy per storage)."""
    return choice_env("MCORE_OFFLOAD_COALESCE_RELOADS", "0", ("0", "1"),
                      "0 or 1: set it to 1 for one reload copy per group, or unset it") == "1"


class CoalescedReloads:
    """The raw transport's coalescing (mixed into ``RawCudaTransport``, which sets ``pool``, ``native``,
    ``device_index``, ``coalesce`` and ``_slices_left`` in its constructor)."""

    coalesce = False
    _last_h2d_done: Any = None  # the latest reload part's done event (RawCudaTransport.to_device)
    pool: Any
    native: Any
    device_index: int
    _slices_left: dict[int, int]

    def _acquire_coalesced(self, sizes: list[int], routed: list[str | None]) -> tuple[list, list]:
        """Host buffers for one copy-out burst (``MCORE_OFFLOAD_COALESCE_RELOADS``): the storages whose size does not
        follow the routing get consecutive, 512-byte aligned slices of one buffer, in order, so that a reload of
        several of them is one copy (:meth:`_coalesced_layout`); routed ones keep buffers of their own."""
        acquire = self.pool.acquire_base
        fixed = [i for i, r in enumerate(routed) if r is None]
        bufs: list = [None] * len(sizes)
        events: list = [None] * len(sizes)
        if len(fixed) > 1:
            offsets, total = [], 0
            for i in fixed:
                offsets.append(total)
                total += slice_span(sizes[i])
            base, events[fixed[0]] = acquire(total, None)
            for i, off in zip(fixed, offsets):
                bufs[i] = base[off:off + sizes[i]]
            self._slices_left[base.data_ptr()] = len(fixed)
        for i, r in enumerate(routed):
            if bufs[i] is None:
                bufs[i], events[i] = acquire(sizes[i], r)
        return bufs, events

    def _coalesced_layout(self, hosts: list, sizes: list[int], ends: list[int]) -> tuple[list, list]:
        """The reload's device storages and copies with ``MCORE_OFFLOAD_COALESCE_RELOADS``: within each part, a run of
        consecutive host slices (one group's storages, as the copy-out laid them out) comes back with one copy into
        one device block, whose regions are the storages. Fewer CUDA calls: in a launch-bound step each costs
        10-20 µs of host time (session 21). Runs never cross a part (each part has its own done event)."""
        runs, first = [], 0
        for end in ends:
            i = first
            while i < end:
                j, ptr = i + 1, hosts[i].data_ptr()
                while j < end and hosts[j].data_ptr() == ptr + slice_span(sizes[j - 1]):
                    ptr = hosts[j].data_ptr()
                    j += 1
                runs.append((i, j))
                i = j
            first = end
        spans = [hosts[b - 1].data_ptr() + sizes[b - 1] - hosts[a].data_ptr() for a, b in runs]
        blocks = self.native.empty_storages(spans, self.device_index)
        out: list = [None] * len(hosts)
        copies: list = [([], [], []) for _ in ends]
        part = 0
        for (a, b), block, span in zip(runs, blocks, spans):
            while a >= ends[part]:
                part += 1
            if b - a == 1:
                out[a] = block
            else:
                origin = hosts[a].data_ptr()
                out[a:b] = self.native.region_storages(block, [hosts[k].data_ptr() - origin for k in range(a, b)],
                                                       sizes[a:b])
            dsts, srcs, lens = copies[part]
            dsts.append(block)
            srcs.append(hosts[a])
            lens.append(span)
        return out, copies

    def returns_to_pool(self) -> bool:
        return not self.coalesce  # coalesced: a block's slices go back together, see release_host

    def release_host(self, buf: torch.Tensor, h2d_event: object) -> None:
        base = buf._base
        if not self.coalesce or base is None or base.data_ptr() not in self._slices_left:
            super().release_host(buf, h2d_event)
            return
        key = base.data_ptr()
        self._slices_left[key] -= 1
        if self._slices_left[key] == 0:
            # Its slices came back in several reload bursts, in H2D stream order: the latest burst covers them all.
            del self._slices_left[key]
            self.pool.release(base, self._last_h2d_done or h2d_event)

    def synchronize(self):
        super().synchronize()
        self._slices_left.clear()
        self._last_h2d_done = None
