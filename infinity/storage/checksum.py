"""CRC32C of host memory, the checksum every swap write records and every swap read is checked against;
and `file_sha256`, the digest the files infinity writes for people (checkpoints, model folders, caches) record.

The native I/O engine computes it per chunk on its worker threads; `crc32c` here serves the aiofiles
backend and tests. The path is chosen at run time: the best this CPU runs, or $INFINITY_CRC32C. "avx512"
folds the data with carry-less multiplication (VPCLMULQDQ on 512-bit vectors) and keeps up with memory
bandwidth; "sse4.2" runs the CPU's crc32 instruction over three streams (about half that speed on data
from DRAM); "table" is for CPUs with neither. All three give the same values.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np
import torch

CRC32C_ENV_VAR = "INFINITY_CRC32C"
CRC32C_PATHS = ("avx512", "sse4.2", "table")  # best first
_PATH_NEEDS = {"avx512": "AVX-512 with VPCLMULQDQ", "sse4.2": "SSE4.2"}


@functools.cache
def _native():
    from infinity._native_loader import load_native

    return load_native().checksum


def supported_crc32c_paths() -> tuple[str, ...]:
    """The paths this CPU runs, best first; always ends with 'table'."""
    return tuple(path for path in CRC32C_PATHS if _native().supported(path))


def resolve_crc32c_path(path: str | None = None) -> str:
    """`path` if given, else $INFINITY_CRC32C if set, else the best this CPU runs; ValueError if unusable."""
    source = "crc32c path"
    if path is None:
        path = os.environ.get(CRC32C_ENV_VAR) or None
        source = CRC32C_ENV_VAR
    if path is None:
        return supported_crc32c_paths()[0]
    if path not in CRC32C_PATHS:
        raise ValueError(f"{source}={path!r} is not a CRC32C path; choose one of {', '.join(CRC32C_PATHS)}")
    if path not in supported_crc32c_paths():
        usable = ", ".join(supported_crc32c_paths())
        raise ValueError(
            f"{source}={path!r} is not supported by this CPU (no {_PATH_NEEDS[path]}); use one of {usable}"
        )
    return path


def crc32c_path_code(path: str) -> int:
    """The native engine's number for a path (its `crc_path` argument)."""
    return _native().path_code(path)


def crc32c_address(address: int, nbytes: int, crc: int = 0, path: str | None = None) -> int:
    """CRC32C of `nbytes` of host memory at `address`, continuing `crc` (0 to start); GIL released."""
    return _native().crc32c(address, nbytes, crc, resolve_crc32c_path(path))


def crc32c(data: torch.Tensor | bytes | bytearray | memoryview, crc: int = 0, path: str | None = None) -> int:
    """CRC32C of a contiguous CPU tensor's bytes (or a bytes-like object), continuing `crc`."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError(f"crc32c needs a contiguous CPU tensor, got one on {data.device}")
        return crc32c_address(data.data_ptr(), data.numel() * data.element_size(), crc, path)
    array = np.frombuffer(data, dtype=np.uint8)  # read-only bytes are fine: nothing is written
    return crc32c_address(array.ctypes.data, array.nbytes, crc, path)


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of A || B from crc32c(A), crc32c(B) and len(B)."""
    return _native().combine(crc_a, crc_b, len_b)


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of the file at `path`, as hex digits, read in 4 MiB pieces."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()
