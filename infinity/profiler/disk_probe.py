"""How fast the swap directory's disk is: a short direct-I/O write and read of a scratch file there.

`probe_disk(directory)` writes PROBE_BYTES to a scratch file through the project's own aio engine
(`storage.aio.open_engine`: O_DIRECT where the filesystem takes it, several requests in flight), reads
them back, verifies every byte, removes the file, and returns what the trace's meta line calls
`raw_disk`: {"read_gbps", "write_gbps", "probe_bytes", "backend", "path"}. Each direction runs
PROBE_ROUNDS times and keeps its fastest round (the first write also converts the file's unwritten
extents). The engine uses PROBE_AIO, not the run's `aio` section, so the probe measures the disk and
not the run's settings: the report states the run's rates as fractions of it.

Ranks started together probe at the same time, so each measures its share of a disk they share.
With the "aiofiles" backend (no O_DIRECT: tmpfs, some network filesystems) the read comes from the
page cache; `backend` says so and the report does not take that read speed for the disk's.
"""

from __future__ import annotations

import errno
import os
import time
import uuid
import warnings
from typing import Any

import torch

from infinity.config import AioConfig
from infinity.storage import StorageError, aligned_empty, open_engine

PROBE_BYTES = 32 << 20
REQUEST_BYTES = 4 << 20  # requests in flight together: PROBE_BYTES / REQUEST_BYTES
PROBE_ROUNDS = 2
PROBE_AIO = AioConfig(block_size=1 << 20, queue_depth=32, intra_op_parallelism=2)


def _transfer_s(engine, f, buf: torch.Tensor, write: bool) -> float:
    """Seconds to move all of `buf` to/from offset 0 of `f` in REQUEST_BYTES requests, all in flight."""
    start = time.perf_counter()
    handles = []
    for offset in range(0, buf.numel(), REQUEST_BYTES):
        piece = buf[offset : offset + REQUEST_BYTES]
        handles.append(engine.write(f, piece, offset) if write else engine.read(f, piece, offset))
    for handle in handles:
        handle.wait()
    if write:
        os.fdatasync(f.fd)  # the page-cached backend's writes reach the disk; O_DIRECT's already have
    return time.perf_counter() - start


def probe_disk(directory: str, nbytes: int = PROBE_BYTES, rounds: int = PROBE_ROUNDS) -> dict[str, Any]:
    """Write and read `nbytes` (a multiple of 4 KiB) in `directory`; the `raw_disk` dict (see the module doc).

    Raises StorageError naming the directory when it cannot be written or a byte read back differs.
    """
    if nbytes <= 0 or nbytes % 4096:
        raise ValueError(f"probe size {nbytes} bytes: give a positive multiple of 4096")
    engine = open_engine(PROBE_AIO, directory)
    path = os.path.join(directory, f".infinity-disk-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    f = None
    try:
        f = engine.open(path, create=True)
        os.posix_fallocate(f.fd, 0, nbytes)
        pattern = aligned_empty(nbytes)
        pattern.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)))
        back = aligned_empty(nbytes)
        write_s = read_s = float("inf")
        for _ in range(max(1, rounds)):
            write_s = min(write_s, _transfer_s(engine, f, pattern, write=True))
            back.zero_()
            read_s = min(read_s, _transfer_s(engine, f, back, write=False))
            if not torch.equal(back, pattern):
                bad = int((back != pattern).nonzero()[0])
                raise StorageError(
                    errno.EIO, f"disk probe: byte {bad} of {nbytes} read back differs from what was written", path
                )
        return {
            "read_gbps": round(nbytes / read_s / 1e9, 3),
            "write_gbps": round(nbytes / write_s / 1e9, 3),
            "probe_bytes": nbytes,
            "backend": engine.backend,
            "path": directory,
        }
    finally:
        if f is not None:
            engine.close_file(f)
        engine.close()
        if os.path.exists(path):
            os.unlink(path)


def nvme_directory(config: Any) -> str | None:
    """The swap directory of an `InfinityConfig` (read by attribute): offload_param's, else offload_optimizer's."""
    zero = config.zero_optimization
    for section in (zero.offload_param, zero.offload_optimizer):
        if section.device == "nvme" and section.nvme_path:
            return section.nvme_path
    return None


def probe_swap_directory(config: Any, rank: int = 0) -> dict[str, Any] | None:
    """`probe_disk` of the config's swap directory; None without NVMe offload or before the directory exists.

    A probe that fails otherwise warns and returns None: profiling never stops a run (the store reports
    the directory's problems itself when it opens its swap file).
    """
    directory = nvme_directory(config)
    if directory is None or not os.path.isdir(directory):
        return None
    try:
        return probe_disk(directory)
    except (OSError, ValueError) as exc:
        warnings.warn(
            f"profiler: rank {rank} could not probe the disk of {directory}: {exc}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
