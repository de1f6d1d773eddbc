"""The memory side of the tier store's moves: a buffer per copy on the device or host tier, accounted to
what it holds (the profiler's holders), a least-recently-used cache of unreferenced copies that reclaim
frees when a tier runs short, and freeing.

`CopyMemory` is a base of `TierMover`, on the state `_init_memory` sets up beside the mover's `_lock`,
`_shards` and `_file`. Reference counts and freeing run under that lock (reclaim takes it); an allocation
that may wait never runs under it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from threading import RLock

import torch

from infinity.storage.buffer_pool import BufferPool
from infinity.storage.device_memory import DeviceMemory
from infinity.storage.nvme_file import NvmeFile
from infinity.storage.recorder import Recorder
from infinity.storage.tier_types import Copy, Shard, Tier, TierBudgets

_HOLDERS = {"param": "param", "master": "optimizer", "moments": "optimizer", "grad": "grad"}


def holder_of(key: Hashable) -> str:
    """What a key's bytes are for, from its last item ((flat, "param"), (flat, "moments"), ...): the
    profiler's holders "param", "optimizer", "grad", or "other"."""
    return _HOLDERS.get(key[-1], "other") if isinstance(key, tuple) and key else "other"


class CopyMemory:
    """Allocation, accounting, caching and freeing of the copies' buffers (see the module docstring)."""

    device: torch.device
    _lock: RLock
    _recorder: Recorder | None
    _shards: dict[Hashable, Shard]
    _file: NvmeFile | None

    def _init_memory(self, budgets: TierBudgets, pin_memory: bool, wait_timeout_s: float) -> None:
        self._holders: dict[tuple[Tier, int], tuple[str, int]] = {}  # (tier, data_ptr) -> (holder, bytes)
        self._held: dict[tuple[Tier, str], int] = {}
        self._held_lock = threading.Lock()
        # Unreferenced copies above their home, least recently used first: what reclaim may free.
        self._idle: dict[Tier, OrderedDict[Hashable, Copy]] = {Tier.DEVICE: OrderedDict(), Tier.HOST: OrderedDict()}
        self._mem = {
            Tier.DEVICE: DeviceMemory(budgets.device_bytes, self.device, wait_timeout_s),
            Tier.HOST: BufferPool(budgets.host_bytes, pin_memory, timeout_s=wait_timeout_s),
        }
        for tier, mem in self._mem.items():
            mem.reclaim = lambda _nbytes, t=tier: self._reclaim(t, demand=True)

    def _alloc(
        self, tier: Tier, nbytes: int, wait: bool, holder: str = "staging", key: Hashable | None = None
    ) -> torch.Tensor | None:
        """A buffer on `tier`, accounted to `holder` (`holder_of(key)` for a key's copy; "staging" else), for
        `key`'s bytes; a wait for memory (the budget spent, nothing to reclaim) goes to the recorder."""
        mem = self._mem[tier]
        if wait:
            recorder = self._recorder
            on_wait = None
            if recorder is not None and hasattr(recorder, "memory_wait"):

                def on_wait(start_ns: int, end_ns: int) -> None:
                    recorder.memory_wait(tier.value, holder, key, start_ns, end_ns)

            buf = mem.acquire(nbytes, on_wait=on_wait)  # reclaims through the hook, then waits
        else:
            while True:
                buf = mem.acquire(nbytes, wait=False)
                if buf is not None or not self._reclaim(tier, demand=False):
                    break
        if buf is not None:
            self._hold(tier, holder, buf, mem._footprint(nbytes))
        return buf

    def _release(self, tier: Tier, buf: torch.Tensor) -> None:
        """Give a buffer `_alloc` returned back to its tier."""
        entry = self._holders.pop((tier, buf.data_ptr()), None)
        if entry is not None:
            self._hold(tier, entry[0], None, -entry[1])
        self._mem[tier].release(buf)

    def _hold(self, tier: Tier, holder: str, buf: torch.Tensor | None, nbytes: int) -> None:
        """Account `nbytes` (negative: given back) to `holder` on `tier`; tell the recorder the new levels."""
        with self._held_lock:
            if buf is not None:
                self._holders[(tier, buf.data_ptr())] = (holder, nbytes)
            held = self._held[(tier, holder)] = self._held.get((tier, holder), 0) + nbytes
        recorder = self._recorder
        if recorder is not None and hasattr(recorder, "held"):
            t = time.perf_counter_ns()
            recorder.live(tier.value, self._mem[tier].live_bytes, t)
            recorder.held(tier.value, holder, held, t)

    def _reclaim(self, tier: Tier, demand: bool) -> bool:
        """Free the least recently used cached copy on `tier`; a prefetched one only for a demand, and last."""
        with self._lock:
            victim = None
            for key, copy in self._idle[tier].items():
                if not copy.ready.is_set() or copy.refs:
                    continue
                if not copy.prefetched:
                    victim = key, copy
                    break
                if demand and victim is None:
                    victim = key, copy
            if victim is None:
                return False
            self._free_copy(self._shards[victim[0]], victim[1])
            return True

    def _ref(self, shard: Shard, copy: Copy) -> None:
        copy.refs += 1
        if self._idle[copy.tier].get(shard.key) is copy:
            del self._idle[copy.tier][shard.key]  # in use: not reclaimable

    def _unref(self, shard: Shard, copy: Copy) -> None:
        copy.refs -= 1
        if copy.refs or copy.home or shard.copies.get(copy.tier) is not copy:
            return
        if self._mem[copy.tier].waiting and copy.ready.is_set():
            self._free_copy(shard, copy)  # someone is waiting for memory: no caching now
        else:
            self._idle[copy.tier][shard.key] = copy
            self._idle[copy.tier].move_to_end(shard.key)

    def _free_copy(self, shard: Shard, copy: Copy) -> None:
        if shard.copies.get(copy.tier) is not copy:
            return  # freed already: its memory may belong to another copy by now
        del shard.copies[copy.tier]
        copy.finish = None
        if self._idle[copy.tier].get(shard.key) is copy:
            del self._idle[copy.tier][shard.key]
        self._release(copy.tier, copy.buf)

    def _free_shard(self, shard: Shard) -> None:
        for copy in list(shard.copies.values()):
            self._free_copy(shard, copy)
        if shard.nvme_offset is not None:
            self._file.free(shard.nvme_offset, shard.nbytes)
