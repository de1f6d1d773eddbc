"""One preallocated swap file per rank: a 4 KiB header, then shards at 4 KiB-aligned offsets.

The file grows with posix_fallocate, so a full disk fails there with ENOSPC (naming the free space),
never in the middle of a write; the hot path creates no files. The first growth is the run's
expected need (`expected_bytes`) when given, else `grow_bytes`. The header (magic, version, rank,
pid, a random run id) lets a later run tell its own stale file (left by a killed process: removed)
from a foreign one or a live run's (refused). The file is removed by close(), at interpreter exit,
when a terminating signal ends the process (`exit_cleanup`), or by the next store on the same path.

Every write records the CRC32C of the bytes written; every read is checked against the checksum
its caller recorded, and the file's identity (inode, size, header) is checked before each access,
so a damaged or changed file raises `ChecksumError` / `SwapFileChangedError`, never gives data.
Memory bound: `used_bytes` (sum of slot sizes) never exceeds `budget_bytes`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
import uuid
import warnings
import weakref

import torch

from infinity.config import AioConfig
from infinity.storage.aio import ALIGN, DoneHandle, Engine, IoFile, IoHandle, open_engine
from infinity.storage.buffer_pool import aligned_empty, round_up
from infinity.storage.disk_space import free_bytes
from infinity.storage.errors import BudgetError, ChecksumError, StorageError, SwapFileError
from infinity.storage.exit_cleanup import register_live_file, unregister_live_file
from infinity.storage.ranges import RangeAllocator
from infinity.storage.swap_identity import WHAT_TO_DO, SwapIdentity

MAGIC = b"INFSWAP\x00"
VERSION = 1
_HEADER = struct.Struct("<8sII16sQQ")  # magic, version, rank, run_id, pid, created_ns
HEADER_BYTES = ALIGN
MIN_GROW_BYTES = 1 << 20


def swap_file_bytes(expected_bytes: int) -> int:
    """The size of a swap file whose store was told `expected_bytes` (its header, then the slots)."""
    return HEADER_BYTES + round_up(expected_bytes)


class _Owned:
    """What the file's finalizer releases: kept apart from the NvmeFile so the finalizer holds no reference to it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.file: IoFile | None = None
        self.identity: SwapIdentity | None = None
        self.cleanup_token = -1

    def release(self) -> None:
        unregister_live_file(self.cleanup_token)
        try:
            self.engine.close()  # finishes the requests in flight first
        finally:
            f = self.file
            if f is not None:
                try:
                    # Never a file someone put in its place; a deleted one is gone already.
                    if self.identity is None or self.identity.still_ours():
                        os.unlink(f.path)
                except FileNotFoundError:
                    pass
                finally:
                    self.engine.close_file(f)


class NvmeFile:
    """Slots in `directory`/infinity-rank{rank}.swap, moved by an engine fit for the directory. Thread-safe.

    `backend` forces "odirect" or "aiofiles"; by default O_DIRECT is used where the filesystem takes it.
    `expected_bytes`: the slot bytes the run will need (the engine's plan); the file's first growth is
    that much (within `budget_bytes`) and later ones an eighth of it (1 MiB to `grow_bytes`). Without
    it the file grows by `grow_bytes`. `crc_path` forces the checksum's path (see `resolve_crc32c_path`).
    """

    def __init__(
        self,
        directory: str,
        rank: int,
        aio: AioConfig,
        budget_bytes: int | None = None,
        grow_bytes: int = 256 << 20,
        backend: str | None = None,
        expected_bytes: int | None = None,
        crc_path: str | None = None,
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.budget_bytes = budget_bytes
        self.grow_bytes = round_up(grow_bytes)
        first = self.grow_bytes
        if expected_bytes is not None:
            if expected_bytes < 0:
                raise ValueError(f"expected_bytes must be >= 0, got {expected_bytes}")
            first = round_up(expected_bytes)
            self.grow_bytes = min(self.grow_bytes, max(MIN_GROW_BYTES, round_up(expected_bytes // 8)))
        if budget_bytes is not None:
            first = min(first, round_up(budget_bytes))
        self.path = os.path.join(directory, f"infinity-rank{rank}.swap")
        self.run_id = uuid.uuid4().bytes
        self.high_water_bytes = 0
        self._lock = threading.Lock()
        self._slots = RangeAllocator()
        self._check_directory()
        try:
            engine = open_engine(aio, directory, backend, crc_path)
        except OSError as exc:
            raise self._startup_error(exc) from None
        self.engine = engine
        owned = _Owned(engine)
        try:
            self._remove_stale()
            owned.file = self._file = engine.open(self.path, create=True)
        except SwapFileError:
            engine.close()
            raise
        except OSError as exc:
            engine.close()
            raise self._startup_error(exc) from None
        self._finalizer = weakref.finalize(self, owned.release)
        fcntl.flock(self._file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owned.cleanup_token = register_live_file(self.path, self._file.fd)
        try:
            self._fallocate(0, HEADER_BYTES)
            header_crc = self._write_header()
            owned.identity = self._identity = SwapIdentity(engine, self._file, HEADER_BYTES, header_crc)
            if first:  # exactly the expected need (growth later comes in grow_bytes steps)
                self._fallocate(self.size_bytes, first)
                self._slots.grow(first)
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
                self._identity.check(self.size_bytes)  # growing a truncated file would hide the truncation
                self._grow(need - self._slots.tail_free())
                slot = self._slots.alloc(need)
            self.high_water_bytes = max(self.high_water_bytes, self._slots.used)
            return HEADER_BYTES + slot

    def free(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._slots.free(offset - HEADER_BYTES, round_up(nbytes))

    def write(self, buf: torch.Tensor, offset: int, nbytes: int) -> IoHandle:
        """Write `buf` (4 KiB-aligned, padded) at `offset`; the handle's `crc32c` is that of its first `nbytes`.

        A file found changed (`SwapFileChangedError`) fails the handle; nothing is written.
        """
        try:
            self._identity.check(self.size_bytes)
        except SwapFileError as exc:
            return DoneHandle(exc)
        return self.engine.write(self._file, buf, offset, nbytes)

    def read(self, buf: torch.Tensor, offset: int, nbytes: int, expected_crc: int, what: str) -> IoHandle:
        """Read into `buf` from `offset`; wait() raises unless the first `nbytes` have CRC32C `expected_crc`.

        `what` names the data in errors (a key). A changed file fails the handle before any read.
        """
        try:
            self._identity.check(self.size_bytes)
        except SwapFileError as exc:
            return DoneHandle(exc)
        io = self.engine.read(self._file, buf, offset, nbytes)
        return _VerifiedRead(self, io, offset, nbytes, expected_crc, what)

    def diagnose(self, needed_end: int = 0) -> str:
        """What is wrong with the file on disk (deleted, replaced, truncated, header overwritten), or ''."""
        return self._identity.find_problem(max(needed_end, self.size_bytes)) or ""

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

    def _write_header(self) -> int:
        header = aligned_empty(HEADER_BYTES)
        header.zero_()
        packed = _HEADER.pack(MAGIC, VERSION, self.rank, self.run_id, os.getpid(), time.time_ns())
        header[: len(packed)].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))
        handle = self.engine.write(self._file, header, 0, HEADER_BYTES)
        handle.wait()
        return handle.crc32c


class _VerifiedRead:
    """A read whose wait() also checks the bytes against the checksum recorded when they were written."""

    def __init__(self, file: NvmeFile, io: IoHandle, offset: int, nbytes: int, expected_crc: int, what: str) -> None:
        self._file = file
        self._io = io
        self._offset = offset
        self._nbytes = nbytes
        self._expected = expected_crc
        self._what = what

    def done(self) -> bool:
        return self._io.done()

    @property
    def crc32c(self) -> int | None:
        return self._io.crc32c

    def wait(self, timeout_s: float | None = None) -> None:
        self._io.wait(timeout_s)
        got = self._io.crc32c
        if got == self._expected:
            return
        f = self._file
        problem = f.diagnose(self._offset + round_up(self._nbytes))
        cause = problem or (
            "the file is still the run's own (same inode, full size, intact header), so these bytes changed "
            "in place: another process wrote into it, or the disk returned bad data"
        )
        raise ChecksumError(
            errno.EIO,
            f"{self._what}: the bytes read back from the swap file '{f.path}' at offset {self._offset}, "
            f"length {self._nbytes} "
            f"are not the ones written (crc32c {got:#010x}, expected {self._expected:#010x}); {cause}; {WHAT_TO_DO}",
            f.path,
        )
