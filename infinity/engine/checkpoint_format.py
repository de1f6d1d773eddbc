"""Reading and writing torch-format files one tensor (or one slice) at a time.

`torch.save` files are zip archives: a pickle (`data.pkl`) whose tensors point at storage records
(`data/<key>`) stored uncompressed. `TorchFileReader` unpickles a file with every tensor left as a
`LazyTensor` (its record, dtype, offset and shape) and reads any element range of one with a single
seek, so a checkpoint can be resharded or consolidated with memory near the largest piece read, not
the file. `write_torch_object` (any object, as `torch.save`) and `write_torch_file` (state dicts) write
the same way: each tensor is produced, written and dropped before the next. The safetensors writer and
the check of a weight file's bytes are `infinity.models.weight_files` (a service: models use them too).
"""

from __future__ import annotations

import collections
import copy
import io
import math
import os
import pickle
import struct
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from infinity.models.weight_files import Produce, TensorSpec, check_produced, write_all

STORAGE_ALIGN = 64  # torch aligns storage records so that `torch.load(mmap=True)` can map them
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_STORAGE_NAMES = {dtype: name for name, dtype in _STORAGE_DTYPES.items()}


class FormatError(RuntimeError):
    """A file is not the torch zip format this module reads, or is shorter than its records say."""


@dataclass(frozen=True)
class LazyTensor:
    """A tensor of a torch file not yet read: `read_range` fetches elements of its flattened view."""

    record: str
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        expected, acc = [], 1
        for size in reversed(self.shape):
            expected.append(acc)
            acc *= size
        return self.numel <= 1 or tuple(reversed(expected)) == self.stride


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


def _lazy_rebuild(storage: _StorageRef, storage_offset, size, stride, *_rest) -> LazyTensor:
    return LazyTensor(storage.key, storage.dtype, int(storage_offset), tuple(size), tuple(stride))


class _LazyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _lazy_rebuild
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> _StorageRef:
        kind, storage_type, key, _location, numel = pid
        if kind != "storage" or not isinstance(storage_type, _StorageType):
            raise FormatError(f"unsupported storage reference {pid!r}")
        return _StorageRef(str(key), storage_type.dtype, int(numel))


class TorchFileReader:
    """A `torch.save` file opened without reading its tensors; `obj` is its content with LazyTensors."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError) as exc:
            raise FormatError(f"'{self.path}' is not a torch zip file: {exc}") from exc
        pickles = [n for n in self._zip.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise FormatError(f"'{self.path}' has {len(pickles)} data.pkl records; expected one")
        self._prefix = pickles[0][: -len("data.pkl")]
        self.obj = _LazyUnpickler(io.BytesIO(self._zip.read(pickles[0]))).load()
        self._offsets: dict[str, int] = {}
        self._file = open(self.path, "rb")  # noqa: SIM115 - closed by close()

    def _data_offset(self, key: str) -> int:
        if key not in self._offsets:
            info = self._zip.getinfo(f"{self._prefix}data/{key}")
            if info.compress_type != zipfile.ZIP_STORED:
                raise FormatError(f"record data/{key} of '{self.path}' is compressed; torch never compresses them")
            self._file.seek(info.header_offset)
            header = self._file.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            self._offsets[key] = info.header_offset + 30 + name_len + extra_len
        return self._offsets[key]

    def read_range(self, t: LazyTensor, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Elements [start, end) of `t` flattened, as a new 1-D CPU tensor."""
        end = t.numel if end is None else end
        out = torch.empty(max(0, end - start), dtype=t.dtype)
        self.read_into(t, start, out)
        return out

    def read_into(self, t: LazyTensor, start: int, out: torch.Tensor) -> None:
        """Fill the contiguous 1-D tensor `out` (of `t`'s dtype) with `t`'s flattened elements from `start` on."""
        end = start + out.numel()
        if not t.contiguous:
            raise FormatError(f"tensor in record {t.record} of '{self.path}' is not contiguous")
        if not 0 <= start <= end <= t.numel:
            raise ValueError(f"range [{start}, {end}) is outside a tensor of {t.numel} elements")
        if out.dtype != t.dtype or not out.is_contiguous() or out.dim() != 1:
            raise ValueError(f"out must be a contiguous 1-D {t.dtype} tensor, got {out.dtype} {tuple(out.shape)}")
        item = out.element_size()
        self._file.seek(self._data_offset(t.record) + (t.storage_offset + start) * item)
        got = self._file.readinto(memoryview(out.view(torch.uint8).numpy())) if out.numel() else 0
        if got != out.numel() * item:
            raise FormatError(f"'{self.path}' ends inside record data/{t.record}: it is truncated")

    def load(self, t: LazyTensor) -> torch.Tensor:
        return self.read_range(t).view(t.shape)

    def materialize(self, obj: Any) -> Any:
        """`obj` with every LazyTensor inside it (dicts, lists, tuples) read into a real tensor."""
        if isinstance(obj, LazyTensor):
            return self.load(obj)
        if isinstance(obj, dict):
            out = copy.copy(obj)
            for k, v in obj.items():
                out[k] = self.materialize(v)
            return out
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self.materialize(v) for v in obj)
        return obj

    def close(self) -> None:
        self._file.close()
        self._zip.close()

    def __enter__(self) -> TorchFileReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _TensorRef:
    """Pickles as a contiguous tensor whose data is storage record `key` (written separately)."""

    def __init__(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.key, self.shape, self.dtype = key, shape, dtype

    def __reduce_ex__(self, protocol: int):
        stride, acc = [], 1
        for size in reversed(self.shape):
            stride.append(acc)
            acc *= size
        storage = _StorageRef(self.key, self.dtype, math.prod(self.shape))
        args = (storage, 0, torch.Size(self.shape), tuple(reversed(stride)), False, collections.OrderedDict())
        return (torch._utils._rebuild_tensor_v2, args)


class _RefPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            return ("storage", getattr(torch, _STORAGE_NAMES[obj.dtype]), obj.key, "cpu", obj.numel)
        return None


def _aligned_entry(zf: zipfile.ZipFile, name: str):
    """Open a stored zip entry for streaming whose data starts on a STORAGE_ALIGN boundary."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    # The local header is 30 bytes + name + extra; zipfile appends a 20-byte zip64 block to our extra.
    data_start = zf.fp.tell() + 30 + len(name.encode()) + 4 + 20
    pad = (-data_start) % STORAGE_ALIGN
    info.extra = struct.pack("<HH", 0x4246, pad) + b"\0" * pad  # 0x4246 ("FB"): the padding torch itself uses
    return zf.open(info, "w", force_zip64=True)


def _walk(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """`obj` rebuilt with `leaf` applied to every TensorSpec and tensor inside dicts, lists and tuples."""
    if isinstance(obj, (TensorSpec, torch.Tensor)):
        return leaf(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the mapping's type (and a defaultdict's factory)
        for k, v in obj.items():
            out[k] = _walk(v, leaf)
        return out
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_walk(v, leaf) for v in obj)
    return obj


def write_torch_object(path: str | os.PathLike, obj: Any, produce: Produce | None = None) -> None:
    """`torch.save(obj, path)`, except that each TensorSpec inside `obj` is replaced by `produce(spec)`, one at
    a time: every tensor is written and dropped before the next is produced, and only then is the object
    pickled. Plain tensors inside `obj` are written as they are. Specs with equal names or an `alias_of`
    share one storage; a spec's shape and dtype are checked against what `produce` returns."""
    leaves: list[TensorSpec | torch.Tensor] = []
    _walk(obj, lambda leaf: leaves.append(leaf))
    records: dict[Any, tuple[str, tuple[int, ...], torch.dtype]] = {}  # spec name or id(tensor) -> storage

    def ident(leaf: TensorSpec | torch.Tensor) -> Any:
        return (leaf.alias_of or leaf.name) if isinstance(leaf, TensorSpec) else id(leaf)

    with zipfile.ZipFile(os.fspath(path), "w", zipfile.ZIP_STORED) as zf:
        for leaf in leaves:
            if ident(leaf) in records or (isinstance(leaf, TensorSpec) and leaf.alias_of is not None):
                continue
            if isinstance(leaf, TensorSpec):
                tensor = check_produced(leaf, produce(leaf))
            else:
                tensor = leaf.detach().cpu().contiguous()
            key = str(len(records))
            with _aligned_entry(zf, f"archive/data/{key}") as out:
                write_all(out, tensor)
            records[ident(leaf)] = (key, tuple(tensor.shape), tensor.dtype)
            del tensor
        buf = io.BytesIO()
        _RefPickler(buf, protocol=2).dump(_walk(obj, lambda leaf: _TensorRef(*records[ident(leaf)])))
        zf.writestr("archive/data.pkl", buf.getvalue())
        zf.writestr("archive/.format_version", "1")
        zf.writestr("archive/.storage_alignment", str(STORAGE_ALIGN))
        zf.writestr("archive/byteorder", sys.byteorder)
        zf.writestr("archive/version", "3\n")


def write_torch_file(path: str | os.PathLike, specs: list[TensorSpec], produce: Produce) -> None:
    """Write an ordered state dict in torch's format, producing one tensor at a time.

    `torch.load(path)` returns it (tied entries share one storage, as `torch.save` would write them).
    """
    write_torch_object(path, collections.OrderedDict((s.name, s) for s in specs), produce)


def order_aliases_after_sources(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """`specs` reordered so that every alias directly follows the entry it shares data with."""
    specs = list(specs)
    aliases: dict[str, list[TensorSpec]] = {}
    for s in specs:
        if s.alias_of is not None:
            aliases.setdefault(s.alias_of, []).append(s)
    out = []
    for s in specs:
        if s.alias_of is None:
            out.append(s)
            out.extend(aliases.get(s.name, []))
    return out
