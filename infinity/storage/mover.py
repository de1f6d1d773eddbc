"""The move primitives the tier store's policies are built on: load, write home, rehome (their buffers:
`copy_memory`).

A move is issued by the caller under the store's lock (I/O starts at once, nothing blocks there)
and finished on one background thread in issue order, so a move issued after another that it
depends on (a copy from a host copy still loading, a read after a write) always finds it done.
Only allocation may wait, and it never runs under the lock.
"""

from __future__ import annotations

import errno
import functools
import time
from collections.abc import Callable, Hashable
from threading import RLock

import torch

from infinity.config import AioConfig
from infinity.storage.aio import IoHandle
from infinity.storage.buffer_pool import aligned_view, copy_bytes, round_up
from infinity.storage.copy_memory import CopyMemory, holder_of
from infinity.storage.errors import StorageError, SwapFileChangedError, SwapFileError
from infinity.storage.nvme_file import NvmeFile
from infinity.storage.recorder import MoveEvent, Recorder
from infinity.storage.streams import DONE, CopyDone, CopyStream
from infinity.storage.tier_types import Completer, Copy, MoveHandle, Shard, Tier, TierBudgets


class TierMover(CopyMemory):
    """State and move primitives of `TierStore` (see there for the public contract)."""

    def __init__(
        self,
        nvme_path: str | None,
        aio: AioConfig,
        budgets: TierBudgets,
        rank: int,
        device: torch.device | str,
        recorder: Recorder | None,
        pin_memory: bool,
        wait_timeout_s: float,
        backend: str | None,
        nvme_grow_bytes: int,
        expected_nvme_bytes: int | None,
    ) -> None:
        self.rank = rank
        self.device = torch.device(device)
        self.budgets = budgets
        self._recorder = recorder
        self._lock = RLock()
        self._shards: dict[Hashable, Shard] = {}
        self._init_memory(budgets, pin_memory, wait_timeout_s)
        self.copies = CopyStream(self.device, self._mem[Tier.DEVICE].stream)  # every copy to or from the device
        self._file: NvmeFile | None = None
        self.backend: str | None = None
        if nvme_path is not None:
            self._file = NvmeFile(
                nvme_path, rank, aio, budgets.nvme_bytes, nvme_grow_bytes, backend, expected_bytes=expected_nvme_bytes
            )
            self.backend = self._file.engine.backend
        self._completer = Completer()
        self._closed = False

    def close(self) -> None:
        """Finish the moves in flight, then remove the swap file and free every buffer (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._completer.close()
        self.copies.close()
        if self._file is not None:
            self._file.close()
        self._mem[Tier.HOST].close()

    # ---- load: a copy of a shard on the device or host tier ------------------------------------------

    def _load(self, key: Hashable, tier: Tier, wait: bool, prefetched: bool, hold: bool) -> Copy | None:
        """The copy of `key` on `tier`, loading if absent; None when it does not fit and `wait` is off."""
        with self._lock:
            self._check_open()
            shard = self._get(key)
            copy = shard.copies.get(tier)
            if copy is not None:
                if hold:
                    self._ref(shard, copy)
                    copy.prefetched = False
                return copy
            staged_needed = tier is Tier.DEVICE and Tier.HOST not in shard.copies
        staged = None
        if staged_needed:  # NVMe -> host -> device; the host copy stays cached afterwards
            staged = self._load(key, Tier.HOST, wait, prefetched=False, hold=True)
            if staged is None:
                return None
        try:
            buf = self._alloc(tier, shard.nbytes, wait, holder_of(key), key)
        except BaseException:  # a wait that timed out, a copy that can never fit: the staged copy is not needed
            if staged is not None:
                with self._lock:
                    self._unref(shard, staged)
            raise
        with self._lock:
            # Meanwhile another thread may have loaded the copy, dropped the key, or freed the host copy
            # a device copy must come from (NVMe reads land in aligned host buffers only).
            raced = (
                shard.copies.get(tier) is not None
                or self._shards.get(key) is not shard
                or (tier is Tier.DEVICE and Tier.HOST not in shard.copies)
            )
            if buf is not None and not raced and not self._closed:
                return self._issue_load(shard, tier, buf, staged, prefetched, hold)
            if buf is not None:
                self._release(tier, buf)
            if staged is not None:
                self._unref(shard, staged)
            self._check_open()  # close() stops the mover: a load queued now would never finish
            if self._shards.get(key) is not shard:
                raise KeyError(f"{key!r} was dropped while it was being fetched")
            if staged is not None and staged.error is not None:
                raise staged.error  # the host copy it was to come from failed to load: trying again reads it again
            if buf is None:
                return None
        return self._load(key, tier, wait, prefetched, hold)  # not under the lock: it may wait for memory

    def _issue_load(
        self, shard: Shard, tier: Tier, buf: torch.Tensor, staged: Copy | None, prefetched: bool, hold: bool
    ) -> Copy:
        """Under the lock: register the copy in `buf` and start its bytes coming (from the other memory tier's
        copy, or from NVMe); the mover finishes it in order."""
        copy = shard.copies[tier] = Copy(tier, buf, refs=int(hold), prefetched=prefetched)
        if not hold:
            self._idle[tier][shard.key] = copy
        source = staged or shard.copies.get(Tier.DEVICE if tier is Tier.HOST else Tier.HOST)
        if source is not None and source is not staged:
            self._ref(shard, source)
        # a device source may have been written by the caller's stream: the copy comes after that work
        after = self.copies.mark() if source is not None and source.buf.is_cuda else None
        t0 = time.perf_counter_ns() if self._recorder is not None else 0
        # A write in flight is queued ahead of this move; its job reads only after the write is done.
        io = self._read_nvme(shard, buf) if source is None and shard.write_op is None else None
        finish = functools.partial(self._finish_load, shard, copy, source, io, t0, after)
        if shard.write_op is None:  # else it must stay behind the write's job, in the mover's order
            copy.finish = finish
        self._completer.submit(finish)
        return copy

    def _finish_load(
        self, shard: Shard, copy: Copy, source: Copy | None, io, t0: int, after: CopyDone | None = None
    ) -> None:
        with self._lock:
            claimed, copy.claimed = copy.claimed, True
        if claimed:  # the waiter or the mover is finishing it already
            copy.ready.wait()
            return
        error = None
        in_flight = None  # a copy onto the device still running: its consumers wait on its event
        try:
            if source is not None and not source.ready.is_set():  # only when called ahead of the mover
                (source.finish or source.ready.wait)()
                source.ready.wait()
            if source is None:
                if shard.lost is not None:
                    raise SwapFileError(
                        getattr(shard.lost, "errno", None) or errno.EIO,
                        f"{shard.key!r} has no valid copy on nvme: its last write failed ({shard.lost})",
                        self._file.path,
                    )
                (io or self._read_nvme(shard, copy.buf)).wait()
            else:
                if source.error is not None:
                    raise source.error
                done = self._copy(
                    copy.buf[: shard.nbytes], source.buf[: shard.nbytes], Tier.DEVICE in (copy.tier, source.tier), after
                )
                if copy.tier is Tier.DEVICE and not done.done():
                    in_flight = copy.done = done
                else:
                    done.synchronize()  # host code reads a host copy as soon as it is ready
        except StorageError as exc:
            error = self._explain(shard, exc)
        except BaseException as exc:
            error = exc
        with self._lock:
            if source is not None and in_flight is None:
                self._unref(shard, source)
            if error is None:
                if in_flight is None:  # else recorded once complete
                    self._record(shard, source.tier if source is not None else Tier.NVME, copy.tier, t0)
            else:
                copy.error = error
                if shard.copies.get(copy.tier) is copy:
                    self._free_copy(shard, copy)
            copy.ready.set()
            copy.finish = None  # the job refers back to the copy: break the cycle so freed buffers go at once
            if error is None and copy.refs == 0:
                self._mem[copy.tier].poke()  # a waiter may reclaim this copy now that it is loaded
        if in_flight is not None:  # the source is read until the copy completes: released after it, in order
            self._completer.submit(functools.partial(self._finish_device_copy, shard, copy, source, in_flight, t0))

    def _finish_device_copy(self, shard: Shard, copy: Copy, source: Copy, done: CopyDone, t0: int) -> None:
        done.synchronize()
        with self._lock:
            if copy.done is done:
                copy.done = None  # complete: later consumers need not wait
            self._unref(shard, source)
            self._record(shard, source.tier, copy.tier, t0)

    # ---- write: new contents to the home --------------------------------------------------------------

    def _start_write(
        self, shard: Shard, flat: torch.Tensor, source: Copy | None, staging: torch.Tensor | None
    ) -> MoveHandle:
        """Under the lock: drop the other copies, send `flat` (or `staging`, or the source) home."""
        self._check_open()  # close() stops the mover: a write queued now would never finish
        others = [c for c in shard.copies.values() if c is not source and not c.home]
        held = [c.tier.value for c in shard.copies.values() if c is not source and c.refs]  # the home too
        if held:
            raise RuntimeError(f"cannot write {shard.key!r}: its copies on {held} are still fetched; release first")
        for copy in others:
            self._free_copy(shard, copy)
        if source is not None and source.home:
            return MoveHandle(done=True)  # written in place, on the home itself
        if source is not None:
            self._ref(shard, source)
        op = shard.write_op = MoveHandle()
        t0 = time.perf_counter_ns() if self._recorder is not None else 0
        src_tier = source.tier if source is not None else Tier.HOST if flat.device.type == "cpu" else Tier.DEVICE
        after = self.copies.mark() if flat.is_cuda else None  # the caller's stream may still be writing `flat`
        io = None
        if shard.home is Tier.NVME:
            if staging is not None:
                io_buf = staging
            elif source is not None and source.tier is Tier.HOST:
                io_buf = source.buf
            else:
                io_buf = aligned_view(flat)  # the caller's own aligned memory: no staging copy
            try:
                io = self._file.write(io_buf, shard.nvme_offset, shard.nbytes)
            except BaseException as exc:
                self._finish_write(shard, op, source, None, exc)  # the caller still owns `staging`
                raise

        def finish() -> None:
            nonlocal flat, io
            error = crc = None
            try:
                if io is not None:
                    io.wait()
                    crc = io.crc32c
                else:  # the handle promises `flat` may be reused once done: wait for the copy
                    home = shard.copies[shard.home].buf[: shard.nbytes]
                    on_device = shard.home is Tier.DEVICE or flat.is_cuda
                    self._copy(home, flat.view(torch.uint8), on_device, after).synchronize()
            except StorageError as exc:
                error = self._explain(shard, exc, "write")
            except BaseException as exc:
                error = exc
            if error is None:
                self._record(shard, src_tier, shard.home, t0)
            # Once the handle is done the caller may reuse `flat`: a pool that lends memory by use count
            # (CollectiveBuffers) must not see this job still holding it.
            flat = io = None
            self._finish_write(shard, op, source, staging, error, crc)

        self._completer.submit(finish)
        return op

    def _finish_write(
        self,
        shard: Shard,
        op: MoveHandle,
        source: Copy | None,
        staging: torch.Tensor | None,
        error: BaseException | None,
        crc: int | None = None,
    ) -> None:
        with self._lock:
            shard.lost = error if shard.home is Tier.NVME else None
            shard.nvme_crc = crc
            if staging is not None:
                self._release(Tier.HOST, staging)
            if source is not None:
                self._unref(shard, source)
            if shard.write_op is op:
                shard.write_op = None
                self._free_evicted(shard)
        op.finish(error)

    def _only_writing(self, shard: Shard) -> bool:
        """Under the lock: the move in flight on `shard` is a write to its home (or a move of the home down),
        with every copy loaded: evicting need not wait for it (`_free_evicted` ends the eviction)."""
        return shard.write_op is not None and all(c.ready.is_set() for c in shard.copies.values())

    def _evict_copies(self, shard: Shard, mark_held: bool) -> None:
        """Under the lock: free the copies above the home that nobody holds; with `mark_held`, mark the held ones
        to be freed once the write in flight is done (`_free_evicted`)."""
        for copy in list(shard.copies.values()):
            if copy.home:
                continue
            if copy.refs == 0:
                self._free_copy(shard, copy)
            elif mark_held:
                copy.evicted = True

    def _free_evicted(self, shard: Shard) -> None:
        """Under the lock, once the write in flight is done: free the copies evicted meanwhile that nobody holds
        now (the others stay cached, as an eviction after the write would have left them)."""
        for copy in list(shard.copies.values()):
            if copy.evicted:
                copy.evicted = False
                if copy.refs == 0 and not copy.home:
                    self._free_copy(shard, copy)

    def _rehome(self, shard: Shard, to: Tier) -> None:
        """Move the home down to `to`, blocking; copies fetched meanwhile stay as caches of the new home."""
        old = shard.copies[shard.home]
        fetched = old.tier is Tier.DEVICE  # the bytes go down through a host copy
        host_copy = self._load(shard.key, Tier.HOST, wait=True, prefetched=False, hold=True) if fetched else old
        host_copy.ready.wait()
        if host_copy.error is not None:
            raise host_copy.error
        if to is Tier.NVME:
            t0 = time.perf_counter_ns() if self._recorder is not None else 0
            offset = None
            try:
                offset = self._file.allocate(shard.nbytes)
                written = self._file.write(host_copy.buf, offset, shard.nbytes)
                written.wait()
            except BaseException:
                if offset is not None:
                    self._file.free(offset, shard.nbytes)
                if fetched:
                    with self._lock:
                        self._unref(shard, host_copy)
                raise
            self._record(shard, Tier.HOST, Tier.NVME, t0)
        with self._lock:
            if fetched:
                host_copy.refs -= 1
            old.home = False
            shard.home = to
            if to is Tier.NVME:
                shard.nvme_offset, shard.nvme_crc = offset, written.crc32c
            else:
                host_copy.home, host_copy.prefetched = True, False
                self._idle[Tier.HOST].pop(shard.key, None)
            for copy in {id(old): old, id(host_copy): host_copy}.values():
                if not copy.home and copy.refs == 0:
                    self._free_copy(shard, copy)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, on_device: bool, after: CopyDone | None) -> CopyDone:
        """A copy that reads or writes device memory goes on the copy stream; one between host buffers is a
        memcpy on this thread."""
        if on_device:
            return self.copies.copy(dst, src, after)
        copy_bytes(dst, src)
        return DONE

    # ---- helpers --------------------------------------------------------------------------------------

    def _pending(self, shard: Shard, device_copies: bool = True) -> Callable[[], object] | None:
        """A wait for the next move in flight on `shard` (a write, a load, with `device_copies` a copy onto the
        device still reading its source), or None when quiet."""
        if shard.write_op is not None:
            return shard.write_op.wait_quietly
        loading = next((c for c in shard.copies.values() if not c.ready.is_set()), None)
        if loading is not None:
            return loading.ready.wait
        if device_copies and any(c.done is not None for c in shard.copies.values()):
            return self._completer.flush  # a copy onto the device still reads its source: released after it
        return None

    def _read_nvme(self, shard: Shard, buf: torch.Tensor) -> IoHandle:
        """Under the lock (or in the mover's order): a read of the key's slot, checked against its last write."""
        return self._file.read(buf, shard.nvme_offset, shard.nbytes, shard.nvme_crc, f"fetch of {shard.key!r}")

    def _explain(self, shard: Shard, exc: StorageError, verb: str = "fetch") -> StorageError:
        """The error a fetch (or write) raises: which key, and what is wrong with the swap file if anything is."""
        what = f"{verb} of {shard.key!r}"
        if isinstance(exc, SwapFileChangedError) and not exc.strerror.startswith(what):
            return SwapFileChangedError(exc.errno, f"{what}: {exc.strerror}", exc.filename)
        if isinstance(exc, SwapFileError):
            return exc
        diagnosis = self._file.diagnose(shard.nvme_offset + round_up(shard.nbytes)) if self._file else ""
        cls = SwapFileChangedError if diagnosis else StorageError
        return cls(exc.errno, f"{what}: {exc.strerror}" + (f"; {diagnosis}" if diagnosis else ""), exc.filename)

    def _record(self, shard: Shard, src: Tier, dst: Tier, t0: int) -> None:
        recorder = self._recorder
        if recorder is not None:
            recorder.record(
                MoveEvent(shard.key, shard.nbytes, src.value, dst.value, t0, time.perf_counter_ns(), self.rank)
            )

    def _get(self, key: Hashable) -> Shard:
        shard = self._shards.get(key)
        if shard is None:
            raise KeyError(f"{key!r} is not in the store")
        return shard

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the TierStore is closed")
