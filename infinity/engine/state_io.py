"""Full weights in and out, one FlatParam at a time: memory stays near the largest block, not the model.

`iter_full_state` yields the full fp32 weights (every name of a tied weight) and buffers, block by
block; `load_full_state` writes pretrained weights into the shards, reading them tensor by tensor
from a state dict, a torch checkpoint (memory-mapped) or a folder of safetensors files, each file
verified first (`verify_weight_file`).
"""

from __future__ import annotations

import json
import os
import pickle
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from infinity.models.weight_files import verify_weight_file
from infinity.shards.store import ShardStore


def _names_by_param(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


@torch.no_grad()
def iter_full_state(shards: ShardStore, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 CPU tensor) for every parameter name and buffer of the model; every rank must iterate."""
    names = _names_by_param(module)
    for flat in shards.flats:
        values = flat.unflatten(shards.gather_full(flat).cpu())
        for slot, p in zip(flat.slots, flat.params, strict=True):
            tensor = values[slot.fqn].clone()
            for name in names[id(p)]:
                yield name, tensor
        del values
    for name, buf in module.named_buffers():
        yield name, buf.detach().cpu().clone()


@torch.no_grad()
def full_state_dict(shards: ShardStore, module: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 weights on CPU keyed like the unwrapped model's state_dict (every name of a tied weight)."""
    values = dict(iter_full_state(shards, module))
    return OrderedDict((key, values[key]) for key in module.state_dict(keep_vars=True))


class _TensorSource:
    """Named tensors read one at a time from a mapping, a torch file (mmap) or safetensors files."""

    def __init__(self, source: Mapping[str, torch.Tensor] | str | os.PathLike) -> None:
        self._handles: dict[str, object] = {}
        if isinstance(source, Mapping):
            self._tensors = source
            return
        path = Path(source)
        if path.is_dir():
            files = _safetensors_files(path)
            try:
                from safetensors import safe_open
            except ImportError as exc:
                raise ImportError(
                    "reading safetensors needs the 'safetensors' package: pip install safetensors"
                ) from exc
            for f in files:
                verify_weight_file(f)
                handle = safe_open(str(f), framework="pt")
                for key in handle.keys():
                    if key in self._handles:
                        raise ValueError(
                            f"'{key}' is in more than one safetensors file in '{path}'; keep one copy of each "
                            "weight (or an index, model.safetensors.index.json, naming the files to read)"
                        )
                    self._handles[key] = handle
            self._tensors = None
        elif path.is_file():
            verify_weight_file(path)
            try:
                self._tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except (RuntimeError, OSError, pickle.UnpicklingError) as exc:
                raise ValueError(f"weight file '{path}' cannot be read as a torch file: {exc}") from exc
        else:
            raise FileNotFoundError(f"pretrained weights '{path}' do not exist")

    def keys(self) -> set[str]:
        return set(self._handles) if self._tensors is None else set(self._tensors.keys())

    def get(self, key: str) -> torch.Tensor:
        if self._tensors is None:
            return self._handles[key].get_tensor(key)
        return self._tensors[key]


def _safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files to read: those the folder's index names when it has one (a folder may also
    hold stale or unrelated files), else every *.safetensors file in it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ValueError(f"'{index}' is not a safetensors index (no 'weight_map'): {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"'{index}' names files that are not in '{folder}': {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"'{folder}' holds no *.safetensors files")
    return files


@torch.no_grad()
def load_full_state(shards: ShardStore, module: nn.Module, source, strict: bool = True) -> list[str]:
    """Write full weights into every rank's shards (and fp32 masters); returns the names not found."""
    tensors = _TensorSource(source)
    available = tensors.keys()
    names = _names_by_param(module)
    missing: list[str] = []
    for flat in shards.flats:
        found = {
            slot.fqn: next((n for n in names[id(p)] if n in available), None)
            for slot, p in zip(flat.slots, flat.params, strict=True)
        }
        # parameters absent from the source keep their current values
        full = shards.gather_full(flat).cpu() if None in found.values() else torch.zeros(flat.padded_numel)
        for slot in flat.slots:
            name = found[slot.fqn]
            if name is None:
                missing.append(slot.fqn)
                continue
            value = tensors.get(name)
            if tuple(value.shape) != tuple(slot.shape):
                raise ValueError(f"pretrained '{name}' has shape {tuple(value.shape)}, the model {tuple(slot.shape)}")
            full[slot.offset : slot.offset + slot.numel] = value.reshape(-1).float()
        start, end = flat.shard_range
        shards.assign(flat, full[start:end])
        if flat.unsharded:  # gathered or resident weights see the new values at once
            flat.full.copy_(full.to(flat.full.dtype))
    if strict and missing:
        raise KeyError(f"pretrained weights lack {len(missing)} parameter(s), e.g. {missing[:5]}; pass strict=False")
    for name, buf in module.named_buffers():
        if name in available:
            buf.copy_(tensors.get(name))
    return missing
