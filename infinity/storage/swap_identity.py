"""Is the swap file still the one the store wrote? Deleted, replaced, truncated or a foreign header.

`SwapIdentity.check` runs before every read and write: an fstat of the open descriptor and a stat of
the path (a few microseconds), plus a look at the header at most once a second, read asynchronously
through the engine and compared when it is back. A problem found once is final: every later access
raises the same `SwapFileChangedError`, naming the file and what happened.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time

import torch

from infinity.storage.aio import ALIGN, Engine, IoFile, IoHandle
from infinity.storage.errors import SwapFileChangedError

WHAT_TO_DO = (
    "stop this run and resume from its last checkpoint; while a run uses nvme_path, nothing else may delete, "
    "move, truncate or write its infinity-rank*.swap files"
)
HEADER_CHECK_INTERVAL_S = 1.0


class SwapIdentity:
    """The open swap file's inode, the bytes it must hold, and the checksum of its header as written."""

    def __init__(self, engine: Engine, f: IoFile, header_bytes: int, header_crc: int) -> None:
        self.path = f.path
        self._engine = engine
        self._file = f
        st = os.fstat(f.fd)
        self.dev, self.ino = st.st_dev, st.st_ino
        self._header_bytes = header_bytes
        self._header_crc = header_crc
        self._header_buf = mmap.mmap(-1, ALIGN)  # page-aligned, as O_DIRECT wants
        self._header_read: IoHandle | None = None
        self._header_checked_s = time.monotonic()
        self._lock = threading.Lock()
        self.problem: str | None = None

    def check(self, min_size_bytes: int) -> None:
        """Raise `SwapFileChangedError` if the file was deleted, replaced, truncated or its header overwritten."""
        with self._lock:
            if self.problem is None:
                self.problem = self._find_problem(min_size_bytes, wait_for_header=False)
            problem = self.problem
        if problem is not None:
            raise SwapFileChangedError(errno.ESTALE, f"{problem}; {WHAT_TO_DO}", self.path)

    def find_problem(self, min_size_bytes: int) -> str | None:
        """What is wrong with the file (its header read now), or None; a problem found is kept."""
        with self._lock:
            if self.problem is None:
                self.problem = self._find_problem(min_size_bytes, wait_for_header=True)
            return self.problem

    def still_ours(self) -> bool:
        """Whether the path still names the file this store created (so removing it removes nothing else)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (self.dev, self.ino)

    def _find_problem(self, min_size_bytes: int, wait_for_header: bool) -> str | None:
        fd_stat = os.fstat(self._file.fd)
        try:
            path_stat = os.stat(self.path)
        except FileNotFoundError:
            return f"the swap file '{self.path}' was deleted while the run was using it"
        if (path_stat.st_dev, path_stat.st_ino) != (self.dev, self.ino):
            return (
                f"the swap file '{self.path}' was replaced by another file (now inode {path_stat.st_ino}, "
                f"{path_stat.st_size} bytes; the run's was inode {self.ino}) while the run was using it"
            )
        if fd_stat.st_size < min_size_bytes:
            return (
                f"the swap file '{self.path}' is {fd_stat.st_size} bytes, shorter than the {min_size_bytes} bytes "
                "the run allocated: it was truncated while the run was using it"
            )
        return self._header_problem(wait_for_header)

    def _header_problem(self, wait: bool) -> str | None:
        """With `wait`: read the header now and compare. Else compare a look that is back, start one each interval."""
        pending, self._header_read = self._header_read, None
        if wait:
            if pending is not None:
                self._header_result(pending)  # let it finish: its buffer is about to be reused
            pending = self._start_header_read()
            return None if pending is None else self._header_result(pending)
        if pending is not None and not pending.done():
            self._header_read = pending
            return None
        problem = None if pending is None else self._header_result(pending)
        if problem is None and time.monotonic() - self._header_checked_s >= HEADER_CHECK_INTERVAL_S:
            self._header_read = self._start_header_read()
        return problem

    def _start_header_read(self) -> IoHandle | None:
        self._header_checked_s = time.monotonic()
        buf = torch.frombuffer(self._header_buf, dtype=torch.uint8)
        try:
            return self._engine.read(self._file, buf, 0, self._header_bytes)
        except RuntimeError:  # the engine is closing: nothing more to check
            return None

    def _header_result(self, read: IoHandle) -> str | None:
        try:
            read.wait()
        except OSError as exc:
            return f"the header of the swap file '{self.path}' cannot be read back ({exc})"
        if read.crc32c != self._header_crc:
            return (
                f"the header of the swap file '{self.path}' is not the one this run wrote (crc32c "
                f"{read.crc32c:#010x}, expected {self._header_crc:#010x}): the file was overwritten"
            )
        return None
