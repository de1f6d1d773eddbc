"""Async reads and writes between host buffers and files: O_DIRECT natively, aiofiles where refused.

Both engines take contiguous CPU tensors whose address, byte length and file offset are multiples
of 4096, and return an `IoHandle` at once (no GIL held while the I/O runs). `wait()` raises
`StorageError` naming the file, offset, length and errno; a short read is an error, never data.
A handle keeps its buffer alive until the request is done. With `crc_bytes`, the handle's `crc32c`
is the CRC32C of the first `crc_bytes` bytes as transferred (computed on the I/O threads).
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import aiofiles
import torch

from infinity.config import AioConfig, ConfigError
from infinity.storage.checksum import crc32c_address, crc32c_path_code, resolve_crc32c_path
from infinity.storage.errors import StorageError

ALIGN = 4096


class IoHandle(Protocol):
    def wait(self, timeout_s: float | None = None) -> None: ...

    def done(self) -> bool: ...

    @property
    def crc32c(self) -> int | None: ...  # after wait(): of the first crc_bytes bytes; None if not asked for


@dataclass(frozen=True)
class IoFile:
    path: str
    fd: int


class DoneHandle:
    """A handle that is already complete (or already failed)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error

    def wait(self, timeout_s: float | None = None) -> None:
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return True

    crc32c = None


def _as_storage_error(exc: OSError) -> StorageError:
    if isinstance(exc, StorageError):
        return exc
    return StorageError(exc.errno or errno.EIO, exc.strerror or str(exc), exc.filename)


def _check_buffer(buf: torch.Tensor) -> int:
    if buf.device.type != "cpu" or not buf.is_contiguous():
        raise ValueError(
            f"I/O buffers must be contiguous CPU tensors, got one on {buf.device}, contiguous={buf.is_contiguous()}"
        )
    return buf.numel() * buf.element_size()


class _NativeHandle:
    def __init__(self, request, buf: torch.Tensor) -> None:
        self._request = request
        self._buf = buf  # the native engine writes into this memory until the request is done

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            finished = self._request.wait(-1.0 if timeout_s is None else timeout_s)
        except OSError as exc:
            raise _as_storage_error(exc) from None
        if not finished:
            r = self._request
            raise TimeoutError(f"I/O on '{r.path}' at offset {r.offset}, length {r.nbytes} not done in {timeout_s} s")

    def done(self) -> bool:
        return self._request.done()

    @property
    def crc32c(self) -> int | None:
        return self._request.crc32c

    def __del__(self) -> None:
        # Freeing the buffer under an in-flight read would let the kernel write into reused memory.
        if not self._request.done():
            self._request.wait(-1.0)


class _Engine:
    """What both backends share: reads and writes are submissions; files are plain descriptors."""

    def close_file(self, f: IoFile) -> None:
        os.close(f.fd)

    def read(self, f: IoFile, buf: torch.Tensor, offset: int, crc_bytes: int = 0) -> IoHandle:
        return self._submit(False, f, buf, offset, crc_bytes)

    def write(self, f: IoFile, buf: torch.Tensor, offset: int, crc_bytes: int = 0) -> IoHandle:
        return self._submit(True, f, buf, offset, crc_bytes)

    def _submit(self, write: bool, f: IoFile, buf: torch.Tensor, offset: int, crc_bytes: int) -> IoHandle:
        raise NotImplementedError


class DirectEngine(_Engine):
    """The native engine over files opened with O_DIRECT (the page cache is bypassed).

    `crc_path` forces the checksum's path ("avx512", "sse4.2" or "table"; see `resolve_crc32c_path`).
    """

    backend = "odirect"

    def __init__(self, cfg: AioConfig, use_kaio: bool = True, crc_path: str | None = None) -> None:
        from infinity._native_loader import load_native

        self.cfg = cfg
        self.crc_path = resolve_crc32c_path(crc_path)
        try:
            self._engine = load_native().aio.Engine(
                cfg.block_size,
                cfg.queue_depth,
                cfg.intra_op_parallelism,
                cfg.single_submit,
                cfg.overlap_events,
                use_kaio,
                crc32c_path_code(self.crc_path),
            )
        except RuntimeError as exc:  # its worker threads could not start (it names the keys to lower)
            raise ConfigError(f"aio: {exc}") from None
        self.submitter = self._engine.submitter  # "kaio" (kernel AIO) or "pread" (blocking threads)

    def open(self, path: str, create: bool = False) -> IoFile:
        flags = os.O_RDWR | os.O_DIRECT | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            return IoFile(path, os.open(path, flags, 0o600))
        except OSError as exc:
            raise _as_storage_error(exc) from None

    def _submit(self, write: bool, f: IoFile, buf: torch.Tensor, offset: int, crc_bytes: int) -> IoHandle:
        nbytes = _check_buffer(buf)
        return _NativeHandle(self._engine.submit(write, f.fd, f.path, buf.data_ptr(), offset, nbytes, crc_bytes), buf)

    def close(self) -> None:
        """Finish every queued request, then stop the worker threads."""
        self._engine.shutdown()


class _FutureHandle:
    def __init__(self, future: Future, buf: torch.Tensor) -> None:
        self._future = future
        self._buf = buf

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            self._future.result(timeout_s)
        except TimeoutError:
            raise TimeoutError(f"aiofiles I/O not done after {timeout_s} s") from None

    def done(self) -> bool:
        return self._future.done()

    @property
    def crc32c(self) -> int | None:
        if not self._future.done() or self._future.exception() is not None:
            return None
        return self._future.result()


class AiofilesEngine(_Engine):
    """Portable engine on aiofiles: an asyncio loop in a background thread, page-cached I/O.

    Serves where O_DIRECT is refused (ramfs, some FUSE or network filesystems, other OSes).
    Up to intra_op_parallelism x queue_depth requests run at once.
    """

    backend = "aiofiles"
    submitter = "aiofiles"

    def __init__(self, cfg: AioConfig, crc_path: str | None = None) -> None:
        self.cfg = cfg
        self.crc_path = resolve_crc32c_path(crc_path)
        self._executor = ThreadPoolExecutor(
            cfg.intra_op_parallelism * cfg.queue_depth, thread_name_prefix="infinity-aiofiles"
        )
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name="infinity-aiofiles-loop", daemon=True)
        self._thread.start()

    def open(self, path: str, create: bool = False) -> IoFile:
        # The descriptor serves fallocate and keeps the inode; transfers open the path through aiofiles.
        try:
            return IoFile(path, os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600))
        except OSError as exc:
            raise _as_storage_error(exc) from None

    def _submit(self, write: bool, f: IoFile, buf: torch.Tensor, offset: int, crc_bytes: int) -> IoHandle:
        nbytes = _check_buffer(buf)
        if not 0 <= crc_bytes <= nbytes:
            raise ValueError(f"crc_bytes must be in [0, {nbytes}], got {crc_bytes}")
        if not self._loop.is_running():
            raise RuntimeError("the aio engine is closed")
        view = memoryview(buf.view(torch.uint8).numpy()).cast("B")
        coro = self._transfer(write, f.path, view, offset, nbytes, (buf.data_ptr(), crc_bytes))
        return _FutureHandle(asyncio.run_coroutine_threadsafe(coro, self._loop), buf)

    async def _transfer(
        self, write: bool, path: str, view: memoryview, offset: int, nbytes: int, crc_of: tuple[int, int]
    ) -> int | None:
        what = "write" if write else "read"
        done = 0
        try:
            async with aiofiles.open(path, "r+b", buffering=0) as fh:
                await fh.seek(offset)
                while done < nbytes:
                    piece = view[done : done + self.cfg.block_size]
                    n = await (fh.write(piece) if write else fh.readinto(piece))
                    if not n:
                        break
                    done += n
        except OSError as exc:
            raise StorageError(
                exc.errno or errno.EIO,
                f"{what} failed: {exc.strerror or exc} at offset {offset + done}, length {nbytes - done}; "
                f"request offset {offset}, length {nbytes}",
                path,
            ) from None
        if done < nbytes:
            raise StorageError(
                errno.EIO,
                f"short {what}: got {done} of {nbytes} bytes at offset {offset} "
                "(file shorter than expected: truncated?)",
                path,
            )
        if not crc_of[1]:
            return None
        # Off the loop thread, GIL released: the checksum of a large buffer must not stall other transfers.
        return await asyncio.get_running_loop().run_in_executor(None, crc32c_address, *crc_of, 0, self.crc_path)

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            self._executor.shutdown(wait=True)


Engine = DirectEngine | AiofilesEngine


def supports_direct_io(directory: str) -> bool:
    """Whether files in `directory` accept O_DIRECT reads and writes (probed with a scratch file)."""
    probe = os.path.join(directory, f".infinity-odirect-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise _as_storage_error(exc) from None
    try:
        page = mmap.mmap(-1, ALIGN)  # page-aligned, as O_DIRECT wants
        os.pwritev(fd, [page], 0)
        os.preadv(fd, [page], 0)
        return True
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise _as_storage_error(exc) from None
    finally:
        os.close(fd)
        os.unlink(probe)


def open_engine(cfg: AioConfig, directory: str, backend: str | None = None, crc_path: str | None = None) -> Engine:
    """The engine for files under `directory`: "odirect" where the filesystem allows it, else "aiofiles"."""
    if backend is None:
        backend = "odirect" if supports_direct_io(directory) else "aiofiles"
    if backend == "odirect":
        return DirectEngine(cfg, crc_path=crc_path)
    if backend == "aiofiles":
        return AiofilesEngine(cfg, crc_path)
    raise ValueError(f"unknown I/O backend {backend!r}; use 'odirect' or 'aiofiles'")
