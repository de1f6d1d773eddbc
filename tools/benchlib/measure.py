"""Measuring a benchmark process from outside the code it runs: memory, disk traffic, fio, time."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def rss_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM; ru_maxrss would inherit a parent's peak across fork/exec)."""
    return _status_bytes("VmHWM")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).mallinfo2 if name else None
    except (OSError, AttributeError):  # not glibc, or glibc before 2.33
        return None
    if fn is not None:
        fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()


def malloc_live_bytes() -> int | None:
    """Bytes malloc has handed out and not had back, in its heaps and mapped (glibc's mallinfo2: uordblks +
    hblkhd): the live part of the resident set, without the freed memory malloc keeps for reuse; None where
    not glibc 2.33+."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


def disk_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process caused to reach the block device, all threads; direct I/O counts."""
    values = {}
    with open("/proc/self/io") as f:
        for line in f:
            name, _, value = line.partition(":")
            values[name] = int(value)
    return values["read_bytes"], values["write_bytes"] - values.get("cancelled_write_bytes", 0)


def folder_bytes(folder: Path) -> dict[str, int]:
    """Bytes the files under `folder` hold: `apparent` (st_size) and `allocated` (blocks on the disk)."""
    apparent = allocated = 0
    for path in folder.rglob("*"):
        if path.is_file():
            st = path.stat()
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return {"apparent": apparent, "allocated": allocated}


def fio_gbps(path: Path, rw: str, size: int, iodepth: int, block: str = "1M") -> float:
    """Sequential direct-I/O bandwidth of `path` (1e9 bytes/s), libaio, one job; rw is "read" or "write"."""
    cmd = [
        "fio", "--name=raw", f"--filename={path}", f"--size={size}", f"--bs={block}", "--direct=1", f"--rw={rw}",
        "--ioengine=libaio", f"--iodepth={iodepth}", "--numjobs=1", "--output-format=json",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(done.stdout)["jobs"][0]
    return job["read" if rw == "read" else "write"]["bw_bytes"] / 1e9


def raw_disk(folder: Path, size: int, iodepth: int) -> dict[str, float]:
    """fio write then read of one file in `folder` (1 MiB blocks); the file is always removed."""
    path = folder / "fio.bin"
    try:
        write = fio_gbps(path, "write", size, iodepth)
        read = fio_gbps(path, "read", size, iodepth)
    finally:
        path.unlink(missing_ok=True)
    return {"read_gbps": round(read, 3), "write_gbps": round(write, 3)}


def median_time(fn: Callable[[], None], reps: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` over `reps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
