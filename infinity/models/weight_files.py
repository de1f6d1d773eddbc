"""Weight files as models and checkpoints write and read them: the safetensors writer, and the check of a
weight file's bytes before any of its tensors is used.

`write_safetensors_file` writes a state dict one tensor at a time and records the SHA-256 of the whole file
in its header (`__metadata__[CHECKSUM_KEY]`, taken with those 64 digits read as zeros). `verify_weight_file`
checks a torch file's records against the CRC-32s its zip archive holds, and a safetensors file against that
SHA-256. A safetensors file written elsewhere carries none, and a torch file of the legacy (non-zip) format no
checksums: they load unchecked.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

CHECKSUM_KEY = "infinity_sha256"  # in a safetensors header's __metadata__ (see the module docstring)
_NO_DIGEST = "0" * 64
_DIGEST_PREFIX = f'"{CHECKSUM_KEY}":"'.encode()  # the entry as written in the compact JSON header, up to its digits
_ZIP_MAGIC = b"PK\x03\x04"
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write, produced later: its name, shape and dtype (None: whatever is produced, torch
    format only); `alias_of` names the entry whose data it shares (a tied weight)."""

    name: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    alias_of: str | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


Produce = Callable[[TensorSpec], torch.Tensor]


def check_produced(spec: TensorSpec, t: torch.Tensor) -> torch.Tensor:
    """`t` as declared by `spec` (else ValueError naming it), detached, on the CPU and contiguous."""
    if (spec.shape is not None and tuple(t.shape) != spec.shape) or (spec.dtype is not None and t.dtype != spec.dtype):
        raise ValueError(
            f"'{spec.name}' was produced as {tuple(t.shape)} {t.dtype}, declared {spec.shape} {spec.dtype}"
        )
    return t.detach().cpu().contiguous()


def write_all(out, t: torch.Tensor) -> None:
    """Write `t`'s bytes (contiguous, on the CPU) to the binary file `out`."""
    if t.numel():
        out.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))


def write_safetensors_file(
    path: str | os.PathLike, specs: list[TensorSpec], produce: Produce, metadata: dict[str, str] | None = None
) -> None:
    """Write an ordered state dict in the safetensors format, producing one tensor at a time.

    The format (an 8-byte header length, a JSON header of dtypes, shapes and byte ranges, then the data)
    needs no package to write; a tied entry is written as its own copy, since safetensors has no aliases.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors is little-endian; writing it on a big-endian machine is not supported")
    header: dict[str, Any] = {"__metadata__": {**(metadata or {}), CHECKSUM_KEY: _NO_DIGEST}}
    offset = 0
    for spec in specs:
        if spec.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"'{spec.name}' has dtype {spec.dtype}, which safetensors cannot store")
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    by_name = {s.name: s for s in specs}
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        out = _Hashing(f, digest)
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        cached: tuple[str, torch.Tensor] | None = None
        for spec in specs:
            source = by_name[spec.alias_of] if spec.alias_of else spec
            if cached is None or cached[0] != source.name:
                cached = None  # drop the previous tensor before producing the next
                cached = (source.name, check_produced(source, produce(source)))
            write_all(out, cached[1])
        f.seek(8 + raw.index(_digest_field(_NO_DIGEST)) + len(_DIGEST_PREFIX))  # the placeholder's digits
        f.write(digest.hexdigest().encode())


class _Hashing:
    """A binary file's `write`, feeding every byte written to `digest` as well."""

    def __init__(self, f: BinaryIO, digest: Any) -> None:
        self._f, self._digest = f, digest

    def write(self, data: bytes | memoryview) -> int:
        self._digest.update(data)
        return self._f.write(data)


def _digest_field(hexdigest: str) -> bytes:
    """The checksum's entry as `write_safetensors_file` writes it in the header (compact JSON)."""
    return _DIGEST_PREFIX + hexdigest.encode() + b'"'


class DamagedFileError(ValueError):
    """A file infinity wrote no longer holds what it wrote (a checksum does not match, or it is cut short)."""


def _damaged(path: Path, why: str) -> DamagedFileError:
    """The error for a damaged weight file: which file, what is wrong, what to do."""
    return DamagedFileError(
        f"weight file '{path}' cannot be read, it is damaged: {why}; write it again, or copy it again from "
        "where it came from"
    )


def _verify_zip(path: Path) -> None:
    """Every record of a zip archive (a torch file) against its CRC-32."""
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, struct.error) as exc:
        raise _damaged(path, f"it is not a complete zip archive, as torch files are ({exc})") from exc
    if bad is not None:
        raise _damaged(path, f"record '{bad}' does not match the CRC-32 recorded when it was written")


def _verify_safetensors(path: Path) -> None:
    """A safetensors file against the SHA-256 in its header, when it has one (see the module docstring)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            raise _damaged(path, f"its header length ({n}) does not fit in its {size} bytes")
        raw = f.read(n)
        try:
            header = json.loads(raw)
        except ValueError as exc:  # not JSON, or not UTF-8
            raise _damaged(path, f"its header is not a JSON object of tensors ({exc})") from exc
        if not isinstance(header, dict):
            raise _damaged(path, "its header is not a JSON object of tensors")
        metadata = header.get("__metadata__")
        expected = metadata.get(CHECKSUM_KEY) if isinstance(metadata, dict) else None
        if expected is None:
            return  # written elsewhere: safetensors checks the layout when the file is opened
        at = raw.find(_digest_field(str(expected)))
        if at < 0:
            raise _damaged(path, f"its header's {CHECKSUM_KEY} is not a SHA-256")
        digest = hashlib.sha256(head)
        digest.update(raw[:at] + _digest_field(_NO_DIGEST) + raw[at + len(_digest_field(str(expected))) :])
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise _damaged(path, "its SHA-256 differs from the one recorded in its header when it was written")


def verify_weight_file(path: str | os.PathLike) -> None:
    """Check a weight file's bytes before any of its tensors is used (see the module docstring); ValueError
    naming the file and what is wrong when it is damaged or truncated."""
    path = Path(path)
    if path.suffix == ".safetensors":
        _verify_safetensors(path)
        return
    with path.open("rb") as f:
        zipped = f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
    if zipped or path.stat().st_size < len(_ZIP_MAGIC):
        _verify_zip(path)
