"""The pieces every move shares: tier names, per-key state, handles, and the thread that finishes moves."""

from __future__ import annotations

import enum
import queue
import threading
import traceback
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch


class Tier(str, enum.Enum):
    """Where a shard's bytes live, fastest first."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"


TIER_DEPTH = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.NVME: 2}  # lower is faster; "down" means deeper


@dataclass(frozen=True)
class TierBudgets:
    """Byte budgets per tier; None means no limit but the hardware's."""

    device_bytes: int | None = None
    host_bytes: int | None = None
    nvme_bytes: int | None = None


class Copy:
    """A shard's bytes on the device or host tier: the home copy, or a cache of it."""

    __slots__ = ("tier", "buf", "refs", "home", "prefetched", "ready", "error", "finish", "claimed", "done", "evicted")

    def __init__(self, tier: Tier, buf: torch.Tensor, refs: int = 0, home: bool = False, prefetched: bool = False):
        self.tier = tier
        self.buf = buf  # uint8; a host buffer is padded to 4 KiB
        self.refs = refs  # fetches not yet released, plus moves reading from this copy
        self.home = home
        self.prefetched = prefetched  # loaded ahead of use: evicted only after plain cached copies
        self.ready = threading.Event()  # set when loaded (or failed: see error)
        self.error: BaseException | None = None
        # Finishes the load (once, whoever calls first): a waiter calls it to skip the mover's hop.
        self.finish: Callable[[], None] | None = None
        self.claimed = False
        # A device copy's bytes may still be on their way when `ready` is set: consumers wait on this
        # (`CopyDone`) on their own stream; None once complete.
        self.done = None
        self.evicted = False  # evicted while a write to the home read it: freed once that write is done
        if home:
            self.ready.set()


class Shard:
    """One key: a flat tensor's shape of bytes, its home tier and its copies."""

    __slots__ = ("key", "numel", "dtype", "nbytes", "home", "copies", "nvme_offset", "nvme_crc", "write_op", "lost")

    def __init__(self, key: Hashable, numel: int, dtype: torch.dtype, nbytes: int, home: Tier) -> None:
        self.key = key
        self.numel = numel
        self.dtype = dtype
        self.nbytes = nbytes
        self.home = home
        self.copies: dict[Tier, Copy] = {}
        self.nvme_offset: int | None = None
        self.nvme_crc: int | None = None  # CRC32C of the bytes last written to the NVMe slot; reads must match it
        self.write_op: MoveHandle | None = None  # the last write to the home, while in flight
        self.lost: BaseException | None = None  # the home's contents are undefined: its last write failed

    def view(self, copy: Copy) -> torch.Tensor:
        return copy.buf[: self.nbytes].view(self.dtype)


class MoveHandle:
    """A move in flight: `wait()` returns when it is complete or raises its error; `done()` polls."""

    def __init__(self, error: BaseException | None = None, done: bool = False) -> None:
        self._event = threading.Event()
        self._error = error
        if done or error is not None:
            self._event.set()

    def finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        if not self._event.wait(timeout_s):
            raise TimeoutError(f"move not complete after {timeout_s} s")
        if self._error is not None:
            raise self._error

    def wait_quietly(self) -> None:
        self._event.wait()


class FetchHandle:
    """A fetch in flight; `wait()` gives the shard's tensor on the target tier and keeps it until release()."""

    def __init__(self, shard: Shard, copy: Copy, after: MoveHandle | None = None) -> None:
        self._shard = shard
        self._copy = copy
        self._after = after  # a write into this very copy (the home) still in flight

    def done(self) -> bool:
        return self._copy.ready.is_set() and (self._after is None or self._after.done())

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        if self._after is not None and not self._after._event.wait(timeout_s):
            raise TimeoutError(f"fetch of {self._shard.key!r}: a write in flight not done after {timeout_s} s")
        finish = self._copy.finish
        if finish is not None and timeout_s is None and not self._copy.ready.is_set():
            finish()
        if not self._copy.ready.wait(timeout_s):
            raise TimeoutError(f"fetch of {self._shard.key!r} to {self._copy.tier.value} not done after {timeout_s} s")
        if self._copy.error is not None:
            raise self._copy.error
        view = self._shard.view(self._copy)
        done = self._copy.done
        if done is not None:  # the copy into this device copy may still run: the caller's stream waits for it
            done.wait_on_current_stream()
        if view.is_cuda:
            # The copy ran on the store's side stream; the caller's stream now uses the memory too.
            view.record_stream(torch.cuda.current_stream(view.device))
        return view


class Completer:
    """One thread that finishes moves in submission order, so a move queued after another sees it done."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="infinity-tier-mover", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def flush(self) -> None:
        """Return once every job submitted so far has run (never call it from a job)."""
        ran = threading.Event()
        self._jobs.put(ran.set)
        ran.wait()

    def close(self) -> None:
        """Finish every submitted job, then stop."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException:  # jobs report their own failures through handles; this guards the thread
                traceback.print_exc()
            job = None  # not held (with what it holds) while waiting for the next
