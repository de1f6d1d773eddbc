"""A Hugging Face folder's weight files, read and written one tensor at a time.

Reading: `checkpoint_tensors(folder, model)` is a mapping from the model's parameter and buffer names
to tensors read lazily from the folder's files (safetensors or torch, one file or shards listed by an
index), for `engine.load_full_state`. transformers stores some architectures under other names and
layouts than their modules use (a mixture of experts' per-expert matrices fused into one parameter,
a renamed head); where it does, each parameter is assembled from the stored tensors by the element
map that transformers' own save-time conversion (`revert_weight_conversion`) gives when applied to a
tensor of element indices: every such conversion only renames, splits, joins or transposes.

Writing: `write_hf_weights(named_tensors, ...)` takes the engine's full weights as they stream out and
writes `save_pretrained`-compatible safetensors shards (converted back to transformers' stored layout,
tied weights once) holding at most one shard in memory; each carries the SHA-256 that reading checks
(`verify_weight_file`) before any of its tensors is used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_FILE = "pytorch_model.bin"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def _stored_files(folder: Path) -> dict[str, Path]:
    """Stored tensor name -> the file holding it, from the index when the weights are sharded."""
    for index_name in (SAFETENSORS_INDEX, TORCH_INDEX):
        index = folder / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"weight index '{index}' is damaged (no readable 'weight_map'): {exc}") from exc
            files = {name: folder / file for name, file in weight_map.items()}
            missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
            if missing:
                raise FileNotFoundError(f"'{index}' lists weight files that are missing: {', '.join(missing)}")
            return files
    for single in (SAFETENSORS_FILE, TORCH_FILE):
        if (folder / single).is_file():  # its bytes are verified when its tensors are read
            return {name: folder / single for name in _open(folder / single, verify=False).keys()}
    raise FileNotFoundError(
        f"'{folder}' holds no weights: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX} with its shards, "
        f"{TORCH_FILE} or {TORCH_INDEX}"
    )


class _TorchFile:
    """A torch weight file opened memory-mapped, with safetensors' `keys`/`get_tensor` face."""

    def __init__(self, path: Path) -> None:
        self._tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)

    def keys(self):
        return self._tensors.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def _open(path: Path, verify: bool = True):
    """A weight file's tensors by name; with `verify`, its bytes checked first (`verify_weight_file`)."""
    from infinity.models.weight_files import verify_weight_file

    if verify:
        verify_weight_file(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            return safe_open(str(path), framework="pt")
        return _TorchFile(path)
    except Exception as exc:  # a damaged file: name it
        raise ValueError(f"weight file '{path}' cannot be read: {exc}") from exc


def stored_names(model: nn.Module, name: str, shape: torch.Size) -> dict[str, torch.Tensor] | None:
    """How transformers stores the model tensor `name`: stored name -> the indices of the model tensor's
    (flattened) elements it holds; None when transformers has no conversions (it stores names as they are)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    numel = 1
    for size in shape:
        numel *= size
    try:
        return revert_weight_conversion(model, {name: torch.arange(numel).view(shape)})
    except Exception:  # noqa: BLE001 - a conversion that cannot run on an index tensor is not a plain rename
        return None


class CheckpointTensors(Mapping):
    """The folder's weights keyed by the model's parameter (and persistent buffer) names; see the module
    docstring. Names with no stored tensor are absent (load_full_state reports them)."""

    def __init__(self, folder: str | os.PathLike, model: nn.Module) -> None:
        self.folder = Path(folder)
        self._files = _stored_files(self.folder)
        self._handles: dict[Path, object] = {}
        self._pieces: dict[str, tuple[torch.Size, list[tuple[str, torch.Tensor | None]]]] = {}
        persistent = set(model.state_dict(keep_vars=True))
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        for name, tensor in named:
            if name not in persistent or name in self._pieces:
                continue
            if name in self._files:
                self._pieces[name] = (tensor.shape, [(name, None)])
                continue
            converted = stored_names(model, name, tensor.shape)
            if converted and all(stored in self._files for stored in converted):
                self._pieces[name] = (tensor.shape, list(converted.items()))

    def __len__(self) -> int:
        return len(self._pieces)

    def __iter__(self) -> Iterator[str]:
        return iter(self._pieces)

    def __contains__(self, name: object) -> bool:
        return name in self._pieces

    def _read(self, stored: str) -> torch.Tensor:
        path = self._files[stored]
        if path not in self._handles:
            self._handles[path] = _open(path)
        try:
            return self._handles[path].get_tensor(stored)
        except Exception as exc:
            raise ValueError(f"weight file '{path}': tensor '{stored}' cannot be read: {exc}") from exc

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, pieces = self._pieces[name]
        if len(pieces) == 1 and pieces[0][1] is None:
            return self._read(pieces[0][0])
        out: torch.Tensor | None = None
        for stored, index in pieces:
            value = self._read(stored)
            if tuple(value.shape) != tuple(index.shape):
                raise ValueError(
                    f"stored '{stored}' has shape {tuple(value.shape)}; the model's '{name}' needs {tuple(index.shape)}"
                )
            if out is None:
                out = torch.empty(shape.numel(), dtype=value.dtype)
            out[index.reshape(-1)] = value.reshape(-1).to(out.dtype)
        return out.view(shape)


def checkpoint_tensors(folder: str | os.PathLike, model: nn.Module) -> CheckpointTensors:
    return CheckpointTensors(folder, model)


def tied_targets(model: nn.Module) -> set[str]:
    """Names transformers leaves out of a saved file because they are tied to another (re-tied at load)."""
    keys = getattr(model, "_tied_weights_keys", None) or ()
    return set(keys) if isinstance(keys, (dict, list, tuple, set)) else set()


def hf_tensors(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full weights (every name of a tied weight, buffers) as transformers stores them: tied
    copies and non-persistent buffers left out, names and layouts converted back."""
    persistent = set(model.state_dict(keep_vars=True))
    skip_tied = tied_targets(model)
    previous: torch.Tensor | None = None  # the engine yields a tied weight's names one after another
    for name, tensor in named:
        if name not in persistent:
            continue
        tied_copy = tensor is previous
        previous = tensor
        if tied_copy and name in skip_tied:
            continue
        converted = stored_names(model, name, tensor.shape)
        if not converted:
            yield name, tensor
            continue
        flat = tensor.reshape(-1)
        for stored, index in converted.items():
            yield stored, flat[index.reshape(-1)].view(index.shape)


def write_hf_weights(
    tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[Path]:
    """Write (name, tensor) pairs as `model.safetensors`, or as shards with `model.safetensors.index.json`
    when they pass `max_shard_bytes`; one shard is held in memory at a time. Returns the files written."""
    from infinity.models.weight_files import TensorSpec, write_safetensors_file

    folder.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            path = folder / f".shard-{len(parts):05d}.partial"
            specs = [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in shard.items()]
            write_safetensors_file(path, specs, lambda spec: shard[spec.name], {"format": "pt"})
            parts.append((path, list(shard)))
        shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor.detach().cpu().contiguous()
        shard_bytes += nbytes
        total_bytes += nbytes
    flush()
    if len(parts) == 1:
        final = folder / SAFETENSORS_FILE
        os.replace(parts[0][0], final)
        return [final]
    written, weight_map = [], {}
    for k, (path, names) in enumerate(parts, start=1):
        final = folder / f"model-{k:05d}-of-{len(parts):05d}.safetensors"
        os.replace(path, final)
        written.append(final)
        weight_map.update(dict.fromkeys(names, final.name))
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    return [*written, folder / SAFETENSORS_INDEX]
