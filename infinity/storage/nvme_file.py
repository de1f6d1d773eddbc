"""One preallocated swap file per rank: a 4 KiB header, then shards at 4 KiB-aligned offsets.

The file grows in `grow_bytes` steps with posix_fallocate, so a full disk fails there with ENOSPC
(naming the free space), never in the middle of a write; the hot path creates no files. The header
(magic, version, rank, pid, a random run id) lets a later run tell its own stale file (left by a
killed process: removed) from a foreign one or a live run's (refused). The file is removed by
close(), at interpreter exit, or by the next store on the same path and rank.
Memory bound: `used_bytes` (sum of slot sizes) never exceeds `budget_bytes`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import struct
import threading
import time
import uuid
import warnings
import weakref

import torch

from infinity.config import AioConfig
from infinity.storage.aio import ALIGN, Engine, IoFile, IoHandle, open_engine
from infinity.storage.buffer_pool import aligned_empty, round_up
from infinity.storage.errors import BudgetError, StorageError, SwapFileError
from infinity.storage.ranges import RangeAllocator

MAGIC = b"INFSWAP\x00"
VERSION = 1
_HEADER = struct.Struct("<8sII16sQQ")  # magic, version, rank, run_id, pid, created_ns
HEADER_BYTES = ALIGN


def free_bytes(path: str) -> str:
    try:
        free = shutil.disk_usage(path).free
        return f"{free} bytes free ({free / (1 << 30):.2f} GiB)"
    except OSError:
        return "free space unknown"


def _remove(engine: Engine, f: IoFile, path: str) -> None:
    try:
        engine.close()  # finishes the requests in flight first
        engine.close_file(f)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class NvmeFile:
    """Slots in `directory`/infinity-rank{rank}.swap, moved by an engine fit for the directory. Thread-safe.

    `backend` forces "odirect" or "aiofiles"; by default O_DIRECT is used where the filesystem takes it.
    """

    def __init__(
        self,
        directory: str,
        rank: int,
        aio: AioConfig,
        budget_bytes: int | None = None,
        grow_bytes: int = 256 << 20,
        backend: str | None = None,
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.budget_bytes = budget_bytes
        self.grow_bytes = round_up(grow_bytes)
        self.path = os.path.join(directory, f"infinity-rank{rank}.swap")
        self.run_id = uuid.uuid4().bytes
        self.high_water_bytes = 0
        self._lock = threading.Lock()
        self._slots = RangeAllocator()
        self._check_directory()
        try:
            self.engine = engine = open_engine(aio, directory, backend)
        except OSError as exc:
            raise self._startup_error(exc) from None
        try:
            self._remove_stale()
            self._file = engine.open(self.path, create=True)
        except SwapFileError:
            engine.close()
            raise
        except OSError as exc:
            engine.close()
            raise self._startup_error(exc) from None
        self._finalizer = weakref.finalize(self, _remove, engine, self._file, self.path)
        fcntl.flock(self._file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            self._fallocate(0, HEADER_BYTES)
            self._write_header()
            first = self.grow_bytes if budget_bytes is None else min(self.grow_bytes, round_up(budget_bytes))
            if first:
                self._grow(first)
        except OSError as exc:
            self.close()
            raise self._startup_error(exc) from None

    @property
    def used_bytes(self) -> int:
        return self._slots.used

    @property
    def size_bytes(self) -> int:
        return HEADER_BYTES + self._slots.size

    def allocate(self, nbytes: int) -> int:
        """The file offset of a new slot of round_up(nbytes) bytes, growing the file if needed."""
        need = round_up(nbytes)
        with self._lock:
            if self.budget_bytes is not None and self._slots.used + need > self.budget_bytes:
                raise BudgetError(
                    f"nvme: {need} more bytes would exceed the budget of {self.budget_bytes} bytes "
                    f"({self._slots.used} in use) in '{self.path}'"
                )
            slot = self._slots.alloc(need)
            if slot is None:
                self._grow(need - self._slots.tail_free())
                slot = self._slots.alloc(need)
            self.high_water_bytes = max(self.high_water_bytes, self._slots.used)
            return HEADER_BYTES + slot

    def free(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._slots.free(offset - HEADER_BYTES, round_up(nbytes))

    def read(self, buf: torch.Tensor, offset: int) -> IoHandle:
        return self.engine.read(self._file, buf, offset)

    def write(self, buf: torch.Tensor, offset: int) -> IoHandle:
        return self.engine.write(self._file, buf, offset)

    def diagnose(self, needed_end: int = 0) -> str:
        """What is wrong with the file on disk (truncated, header overwritten, replaced), or ''."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return f"the swap file '{self.path}' was deleted behind the store's back"
        size = st.st_size
        if size < max(needed_end, HEADER_BYTES):
            return (
                f"the swap file '{self.path}' is {size} bytes, shorter than the {max(needed_end, HEADER_BYTES)} "
                "the store wrote: it was truncated behind the store's back"
            )
        with open(self.path, "rb") as fh:
            head = fh.read(_HEADER.size)
        if len(head) < _HEADER.size or _HEADER.unpack(head)[:4] != (MAGIC, VERSION, self.rank, self.run_id):
            return f"the header of '{self.path}' is not this run's: the file was overwritten or replaced"
        return ""

    def close(self) -> None:
        """Finish the I/O in flight, stop the engine, close and remove the file (idempotent)."""
        self._finalizer()

    def _check_directory(self) -> None:
        d = self.directory
        if not os.path.exists(d):
            raise StorageError(errno.ENOENT, f"nvme_path '{d}' does not exist; create it or fix the config", d)
        if not os.path.isdir(d):
            raise StorageError(errno.ENOTDIR, f"nvme_path '{d}' is not a directory", d)

    def _remove_stale(self) -> None:
        if not os.path.lexists(self.path):
            return
        try:
            with open(self.path, "rb") as fh:
                head = fh.read(_HEADER.size)
                try:  # a live store holds an exclusive lock on its file; pids are reused, locks are not
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    live = False
                except BlockingIOError:
                    live = True
        except OSError as exc:
            raise SwapFileError(exc.errno or errno.EIO, f"cannot read existing swap file: {exc}", self.path) from None
        if len(head) < _HEADER.size or head[:8] != MAGIC:
            raise SwapFileError(
                errno.EEXIST,
                "a file that is not an infinity swap file is in the way; it is left untouched: "
                "move it or choose another nvme_path",
                self.path,
            )
        _, version, rank, _, pid, _ = _HEADER.unpack(head)
        if live:
            raise SwapFileError(
                errno.EBUSY,
                f"swap file of a live run (pid {pid}, rank {rank}); give each run its own nvme_path",
                self.path,
            )
        warnings.warn(
            f"removing stale swap file '{self.path}' (version {version}, rank {rank}) left by pid {pid}, now gone",
            stacklevel=3,
        )
        os.unlink(self.path)

    def _startup_error(self, exc: OSError) -> StorageError:
        return StorageError(
            exc.errno or errno.EIO,
            f"nvme_path '{self.directory}' cannot hold the swap file: {exc.strerror or exc} "
            f"({free_bytes(self.directory)})",
            self.path,
        )

    def _grow(self, need: int) -> None:
        extra = max(self.grow_bytes, need)
        if self.budget_bytes is not None:
            extra = max(need, min(extra, self.budget_bytes - self._slots.size))
        self._fallocate(self.size_bytes, extra)
        self._slots.grow(extra)

    def _fallocate(self, offset: int, length: int) -> None:
        try:
            os.posix_fallocate(self._file.fd, offset, length)
        except OSError as exc:
            raise StorageError(
                exc.errno,
                f"cannot grow the swap file by {length} bytes to {offset + length} bytes: {exc.strerror} "
                f"({free_bytes(self.directory)} in '{self.directory}')",
                self.path,
            ) from None

    def _write_header(self) -> None:
        header = aligned_empty(HEADER_BYTES)
        header.zero_()
        packed = _HEADER.pack(MAGIC, VERSION, self.rank, self.run_id, os.getpid(), time.time_ns())
        header[: len(packed)].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))
        self.write(header, 0).wait()
