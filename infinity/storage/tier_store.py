"""A store of keyed flat shards, each with a home tier, moved between device, host and NVMe in budgets.

Copies above a key's home are caches. `fetch` makes one (or shares the one there, counting
references); `release` drops a reference and leaves the copy cached until memory is needed (freed
at once if someone is waiting for memory); `write` sends new contents to the home and drops the
other copies; `prefetch` loads keys in order while they fit without waiting; `evict` frees cached
copies or moves the home down; `drop` forgets a key. Live bytes per tier never exceed the budgets
(`stats` keeps the high-water marks). All methods are thread-safe.

On a machine without CUDA the "device" tier is CPU memory with its own budget, so the same logic
runs everywhere; with CUDA, copies to and from the device run on a copy stream (`streams`): a fetch's
wait() makes the caller's stream wait for the copy's event, and the source stays referenced until it is done.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import torch

from infinity.config import AioConfig, ConfigError, OffloadOptimizerConfig, OffloadParamConfig
from infinity.storage.buffer_pool import aligned_view, copy_bytes, round_up
from infinity.storage.copy_memory import holder_of
from infinity.storage.mover import TierMover
from infinity.storage.recorder import Recorder
from infinity.storage.tier_types import TIER_DEPTH, Copy, FetchHandle, MoveHandle, Shard, Tier, TierBudgets


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("shards must be contiguous tensors; call .contiguous() first")
    if tensor.numel() == 0:
        raise ValueError("shards must hold at least one element")
    return tensor.reshape(-1)


class TierStore(TierMover):
    """Keyed shards on the "device", "host" and "nvme" tiers; see the module docstring for the contract.

    `nvme_path` None: no NVMe tier. A missing, unwritable or full path raises `StorageError` here,
    naming the path and its free space. The swap file is removed by close(), the context manager,
    at interpreter exit, or when a terminating signal ends the process. `wait_timeout_s` bounds
    every wait for memory (then `BudgetError`).

    `expected_nvme_bytes`: the bytes the run will put on NVMe (the sum of round_up(nbytes, 4096) over
    its NVMe keys); the swap file's first growth is that much rather than `nvme_grow_bytes`. Every
    NVMe read is checked against the CRC32C of its write: a fetch of damaged bytes raises
    `ChecksumError`, of a deleted, replaced, truncated or overwritten file `SwapFileChangedError`.
    """

    def __init__(
        self,
        nvme_path: str | None,
        aio: AioConfig,
        budgets: TierBudgets,
        rank: int = 0,
        device: torch.device | str = "cpu",
        recorder: Recorder | None = None,
        pin_memory: bool = False,
        wait_timeout_s: float = 300.0,
        backend: str | None = None,
        nvme_grow_bytes: int = 256 << 20,
        expected_nvme_bytes: int | None = None,
    ) -> None:
        super().__init__(
            nvme_path,
            aio,
            budgets,
            rank,
            device,
            recorder,
            pin_memory,
            wait_timeout_s,
            backend,
            nvme_grow_bytes,
            expected_nvme_bytes,
        )

    @classmethod
    def from_config(
        cls,
        offload_param: OffloadParamConfig,
        offload_optimizer: OffloadOptimizerConfig,
        aio: AioConfig,
        budgets: TierBudgets,
        rank: int = 0,
        device: torch.device | str = "cpu",
        recorder: Recorder | None = None,
        expected_nvme_bytes: int | None = None,
    ) -> TierStore:
        """A store for the offload sections: one nvme_path shared by both, pinned if either asks."""
        paths = {}
        for name, section in (("offload_param", offload_param), ("offload_optimizer", offload_optimizer)):
            if section.device == "nvme":
                if not section.nvme_path:
                    raise ConfigError(f"'zero_optimization.{name}.nvme_path' is required when its device is 'nvme'")
                paths[name] = section.nvme_path
        if len(set(paths.values())) > 1:
            raise ConfigError(
                f"offload_param and offload_optimizer name different nvme_path values {paths}; "
                "one TierStore uses one path: give both the same path or build one store each"
            )
        pin = offload_param.pin_memory or offload_optimizer.pin_memory
        path = next(iter(paths.values()), None)
        return cls(
            path,
            aio,
            budgets,
            rank=rank,
            device=device,
            recorder=recorder,
            pin_memory=pin,
            expected_nvme_bytes=expected_nvme_bytes,
        )

    def put(self, key: Hashable, tensor: torch.Tensor, home: Tier | str) -> MoveHandle:
        """Store a copy of `tensor` (any dtype, contiguous) under a new key whose home is `home`.

        Like `write`, the store may read `tensor` until the returned handle is done.
        """
        home = Tier(home)
        flat = _flat(tensor)
        shard = Shard(key, flat.numel(), flat.dtype, flat.numel() * flat.element_size(), home)
        with self._lock:
            self._check_open()
            if key in self._shards:
                raise KeyError(f"{key!r} is already stored; write() replaces its contents")
        if home is Tier.NVME and self._file is None:
            raise ValueError(f"cannot put {key!r} on nvme: this store has no nvme_path")
        staging = None
        try:
            if home is Tier.NVME:
                shard.nvme_offset = self._file.allocate(shard.nbytes)
                if aligned_view(flat) is None:  # O_DIRECT needs 4 KiB-aligned memory: stage a copy
                    staging = self._alloc(Tier.HOST, shard.nbytes, wait=True, key=key)
                    copy_bytes(staging[: shard.nbytes], flat)
            else:
                buf = self._alloc(home, shard.nbytes, wait=True, holder=holder_of(key), key=key)
                shard.copies[home] = Copy(home, buf, home=True)
            with self._lock:  # registered and written in one step: no one sees the key before its write
                if key in self._shards:
                    raise KeyError(f"{key!r} was stored by another thread meanwhile")
                self._shards[key] = shard
                try:
                    handle = self._start_write(shard, flat, None, staging)
                except BaseException:
                    del self._shards[key]
                    raise
                staging = None  # the write owns it now
                return handle
        except BaseException:
            with self._lock:
                self._free_shard(shard)
            raise
        finally:
            if staging is not None:
                self._release(Tier.HOST, staging)

    def fetch(self, key: Hashable, tier: Tier | str) -> FetchHandle:
        """Start bringing `key` to "device" or "host"; the handle's wait() gives the tensor there.

        A copy already there (or on its way) is shared at once. Each fetch holds one reference until
        `release(key, tier)`; a fetch whose wait() raised the move's error holds none, one whose wait(timeout_s)
        ran out still holds it (wait again, or release). Waits while the tier is full.
        """
        tier = self._target(tier)
        copy = self._load(key, tier, wait=True, prefetched=False, hold=True)
        with self._lock:  # a later write sees this reference and refuses; an earlier one is waited for
            # The shard is looked up only now: the key may have been dropped and put again before the load, and
            # the put's write into the new home copy may still run. The reference held stops any further drop.
            shard = self._get(key)
            return FetchHandle(shard, copy, shard.write_op if copy.home else None)

    def fetch_to_overwrite(self, key: Hashable, tier: Tier | str) -> torch.Tensor:
        """A held copy of `key` on `tier` that the caller overwrites whole and then `write`s in place (which
        keeps it as the cached copy). Made without reading the home when no copy is there; a copy that is
        there is shared once loaded. Release it as a fetch; until the write, its bytes are garbage, and the caller
        must be the key's only user: a fetch of the key meanwhile (or a load of it to the other tier) would share
        them."""
        tier = self._target(tier)
        with self._lock:
            self._check_open()
            shard = self._get(key)
            there = tier in shard.copies
        if not there:
            buf = self._alloc(tier, shard.nbytes, wait=True, holder=holder_of(key), key=key)
            with self._lock:
                if shard.copies.get(tier) is None and self._shards.get(key) is shard:
                    copy = shard.copies[tier] = Copy(tier, buf, refs=1)
                    copy.ready.set()
                    return shard.view(copy)
                self._release(tier, buf)  # another thread made the copy, or the key was dropped
        return self.fetch(key, tier).wait()

    def release(self, key: Hashable, tier: Tier | str, keep: bool = False) -> None:
        """The caller is done with one fetched copy: it stays cached until memory is needed. With `keep`
        (someone reads it again soon) it is kept from eviction as a prefetched copy is."""
        tier = Tier(tier)
        with self._lock:
            shard = self._shards.get(key)
            copy = shard.copies.get(tier) if shard is not None else None
            if copy is None:
                return  # its fetch failed (no reference was held) or the key was dropped
            if copy.refs <= 0:
                raise RuntimeError(f"release of {key!r} on {tier.value} without a fetch to match it")
            copy.prefetched = copy.prefetched or keep
            self._unref(shard, copy)

    def write(self, key: Hashable, tensor: torch.Tensor) -> MoveHandle:
        """Send new contents for `key` to its home, asynchronously; its other copies are dropped.

        Writing a fetched copy in place keeps that copy. To NVMe, a host copy or any 4 KiB-aligned
        CPU tensor (`aligned_empty`) is written in place; other tensors through a staging buffer.
        Do not modify `tensor` until the handle is done. Raises if another copy of the key is still
        fetched. A failed write to NVMe makes later fetches from there raise until a write succeeds.
        """
        flat = _flat(tensor)
        staging = None
        try:
            while True:
                with self._lock:
                    shard = self._get(key)
                    if flat.numel() != shard.numel or flat.dtype != shard.dtype:
                        raise ValueError(
                            f"write of {key!r}: got {flat.numel()} x {flat.dtype}, stored {shard.numel} x {shard.dtype}"
                        )
                    pending = self._pending(shard)
                    if pending is None:
                        source = next(
                            (
                                c
                                for c in shard.copies.values()
                                if c.buf.data_ptr() == flat.data_ptr() and c.buf.device == flat.device
                            ),
                            None,
                        )
                        staged = (
                            shard.home is Tier.NVME
                            and (source is None or source.tier is not Tier.HOST)
                            and aligned_view(flat) is None
                        )
                        if staged == (staging is not None):
                            handle = self._start_write(shard, flat, source, staging)
                            staging = None  # the write owns it now
                            return handle
                if pending is not None:
                    pending()
                elif staging is None:  # O_DIRECT needs an aligned host buffer; allocating may wait
                    staging = self._alloc(Tier.HOST, shard.nbytes, wait=True, key=key)
                    copy_bytes(staging[: shard.nbytes], flat)
                else:
                    self._release(Tier.HOST, staging)
                    staging = None
        finally:
            if staging is not None:
                self._release(Tier.HOST, staging)

    def prefetch(self, keys: Iterable[Hashable], tier: Tier | str) -> list[Hashable]:
        """Start loading `keys` to `tier` in order, holding no references, while they fit without waiting.

        Copies already there are kept from eviction. Stops at the first key that does not fit (never
        over budget, never waits); returns the keys that are there or on their way. Prefetched copies
        are evicted only after plain cached ones, and only for a fetch that would otherwise wait.
        """
        tier = self._target(tier)
        keys = list(keys)
        missing = set()
        with self._lock:
            for key in keys:
                copy = self._get(key).copies.get(tier)
                if copy is None:
                    missing.add(key)
                elif key in self._idle[tier]:
                    copy.prefetched = True
                    self._idle[tier].move_to_end(key)
        for i, key in enumerate(keys):
            if key in missing and self._load(key, tier, wait=False, prefetched=True, hold=False) is None:
                return keys[:i]
        return keys

    def evict(self, key: Hashable, to: Tier | str | None = None) -> None:
        """Free the key's unreferenced cached copies; with `to` below its home, move the home down there.

        Moving the home blocks until the bytes are there, and needs the old home copy unreferenced.
        """
        to = None if to is None else Tier(to)
        while True:
            with self._lock:
                shard = self._get(key)
                # freeing a device copy still being written is safe (the allocator orders its reuse after the
                # copy; its source stays referenced): only moving the home down waits for such copies
                pending = self._pending(shard, device_copies=to is not None)
                if pending is not None and to is None and self._only_writing(shard):
                    self._evict_copies(shard, mark_held=True)  # the write reads a copy but changes none
                    return
                if pending is None:
                    self._evict_copies(shard, mark_held=False)
                    if to is None or to is shard.home:
                        return
                    if TIER_DEPTH[to] < TIER_DEPTH[shard.home]:
                        raise ValueError(f"evict moves down; {to.value} is above {key!r}'s home {shard.home.value}")
                    if shard.copies[shard.home].refs:
                        raise RuntimeError(f"cannot move {key!r} down: its home copy is still fetched")
                    op = shard.write_op = MoveHandle()  # writes and drops of the key wait for the move
                    break
            pending()
        try:
            self._rehome(shard, to)
        finally:
            with self._lock:
                shard.write_op = None
                self._free_evicted(shard)
            op.finish()

    def drop(self, key: Hashable) -> None:
        """Forget `key` and free its space on every tier, once its moves in flight are done."""
        while True:
            with self._lock:
                shard = self._get(key)
                pending = self._pending(shard)
                if pending is None:
                    held = [c.tier.value for c in shard.copies.values() if c.refs]
                    if held:
                        raise RuntimeError(f"cannot drop {key!r}: fetched copies on {held} are still in use")
                    del self._shards[key]
                    self._free_shard(shard)
                    return
            pending()

    def live_bytes(self, tier: Tier | str) -> int:
        """Bytes held on `tier` now: copies, staging buffers and NVMe slots (padded to 4 KiB off the device)."""
        tier = Tier(tier)
        if tier is Tier.NVME:
            return self._file.used_bytes if self._file is not None else 0
        return self._mem[tier].live_bytes

    def high_water_bytes(self, tier: Tier | str) -> int:
        """The most `live_bytes(tier)` has been; never above that tier's budget."""
        tier = Tier(tier)
        if tier is Tier.NVME:
            return self._file.high_water_bytes if self._file is not None else 0
        return self._mem[tier].high_water_bytes

    def reset_high_water(self, tier: Tier | str) -> None:
        """Start `high_water_bytes(tier)` afresh from the bytes held now (memory tiers)."""
        tier = Tier(tier)
        if tier is not Tier.NVME:
            self._mem[tier].reset_high_water()

    def stats(self) -> dict[str, dict[str, int | None]]:
        """Per tier: live bytes, high-water mark and budget."""
        budgets = {
            Tier.DEVICE: self.budgets.device_bytes,
            Tier.HOST: self.budgets.host_bytes,
            Tier.NVME: self.budgets.nvme_bytes,
        }
        return {
            t.value: {
                "live_bytes": self.live_bytes(t),
                "high_water_bytes": self.high_water_bytes(t),
                "budget_bytes": budgets[t],
            }
            for t in Tier
        }

    def tiers_holding(self, key: Hashable) -> list[str]:
        """The tiers holding a loaded copy of `key`, its home included, fastest first."""
        with self._lock:
            shard = self._get(key)
            tiers = {t for t, c in shard.copies.items() if c.ready.is_set() and c.error is None} | {shard.home}
            return [t.value for t in sorted(tiers, key=TIER_DEPTH.get)]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._shards

    def __len__(self) -> int:
        return len(self._shards)

    def location(self, key: Hashable) -> tuple[str, int, int] | None:
        """(swap file, offset, padded bytes) of `key`'s NVMe slot, or None; for tools and debugging."""
        with self._lock:
            shard = self._get(key)
            if shard.nvme_offset is None:
                return None
            return self._file.path, shard.nvme_offset, round_up(shard.nbytes)

    @property
    def swap_path(self) -> str | None:
        return self._file.path if self._file is not None else None

    def __enter__(self) -> TierStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _target(self, tier: Tier | str) -> Tier:
        tier = Tier(tier)
        if tier is Tier.NVME:
            raise ValueError("fetch and prefetch bring keys to 'device' or 'host'; evict(key, 'nvme') moves one down")
        return tier
