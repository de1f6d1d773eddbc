"""Free space on the swap path, checked up front against what a run will write there."""

from __future__ import annotations

import errno
import os
import shutil

from infinity.storage.errors import StorageError

GiB = 1 << 30
MiB = 1 << 20


def _size(nbytes: int) -> str:
    """`nbytes` in GiB, or in MiB below one GiB (where 0.01 GiB would hide the difference between two sizes)."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


def free_bytes(path: str) -> str:
    """The free space under `path` in words, for error messages."""
    try:
        free = shutil.disk_usage(path).free
        return f"{free} bytes free ({_size(free)})"
    except OSError:
        return "free space unknown"


def write_failure(exc: BaseException, what: str, path: str | os.PathLike, instead: str) -> BaseException:
    """What to raise for `exc`, which stopped writing `what` at `path`: an OSError of the write itself (a full
    disk, permissions) names them and the free space beside `path`, and suggests `instead`; anything else
    (a swap read's StorageError, an interrupt) as it is."""
    if not isinstance(exc, OSError) or isinstance(exc, StorageError):
        return exc
    where = os.path.dirname(os.path.abspath(path))
    why = f"{exc.strerror or exc} ({free_bytes(where)})"
    return OSError(exc.errno, f"cannot write {what} '{path}': {why}; free space there or {instead}", str(path))


def check_free_space(nvme_path: str, needed_bytes: int, what: str = "the swap files") -> None:
    """Raise `StorageError` (ENOSPC) if `nvme_path` has less than `needed_bytes` free, saying both figures."""
    if not os.path.isdir(nvme_path):
        message = f"nvme_path '{nvme_path}' is not an existing directory; create it or fix the config"
        raise StorageError(errno.ENOENT, message, nvme_path)
    free = shutil.disk_usage(nvme_path).free
    if free < needed_bytes:
        raise StorageError(
            errno.ENOSPC,
            f"nvme_path '{nvme_path}' has {free} bytes free ({_size(free)}) but {what} need {needed_bytes} bytes "
            f"({_size(needed_bytes)}); free {needed_bytes - free} bytes there, choose an nvme_path on a larger "
            "disk, or keep more state in host memory",
            nvme_path,
        )
