"""The consolidated 16-bit model file (`stage3_gather_16bit_weights_on_model_save`), as DeepSpeed writes it.

The full weights in the compute dtype (bf16 or fp16; fp32 in an fp32 run, as DeepSpeed saves the module's
own dtype), keyed like the model's `state_dict()` with its persistent buffers, gathered block by block and
written by rank 0 one tensor at a time: torch's format (`pytorch_model.bin`, tied weights sharing one
storage) or safetensors (a `.safetensors` name, tied weights as copies). Every rank must call it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

from infinity.engine.checkpoint_format import order_aliases_after_sources, write_torch_file
from infinity.engine.state_io import iter_full_state
from infinity.models.weight_files import TensorSpec, write_safetensors_file
from infinity.shards.store import ShardStore
from infinity.storage.disk_space import write_failure

DEFAULT_FILENAME = "pytorch_model.bin"


def _specs(shards: ShardStore, module: nn.Module) -> list[TensorSpec]:
    """One spec per state-dict key (a parameter's shape from its flat: sharded, it is empty); a tied weight's
    later names alias its first."""
    shapes = {id(p): slot.shape for flat in shards.flats for slot, p in zip(flat.slots, flat.params, strict=True)}
    first: dict[int, str] = {}
    specs = []
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in shapes:
            source = first.setdefault(id(tensor), key)
            alias = None if source == key else source
            specs.append(TensorSpec(key, tuple(shapes[id(tensor)]), shards.placement.compute_dtype, alias))
        else:
            specs.append(TensorSpec(key, tuple(tensor.shape), tensor.dtype))
    return specs


def _stream_order(shards: ShardStore, module: nn.Module) -> list[str]:
    """The names in the order `iter_full_state` yields them: flat by flat, each parameter's every name."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [name for flat in shards.flats for p in flat.params for name in names.get(id(p), [])]


def write_16bit_model(shards: ShardStore, module: nn.Module, path: str | os.PathLike) -> Path:
    """Write the model's full compute-dtype weights to `path` (rank 0; every rank gathers); returns the path."""
    path = Path(path)
    named = iter_full_state(shards, module)
    if shards.comm.rank != 0:
        for _ in named:
            pass
        shards.comm.barrier("16-bit model written")
        return path
    specs = _specs(shards, module)
    # Written in the order the weights stream out (block by block), so at most a block waits in `pending`;
    # any other order would still be right, only holding more.
    position = {name: i for i, name in enumerate(_stream_order(shards, module))}
    specs.sort(key=lambda s: position.get(s.alias_of or s.name, len(position)))
    wanted = {s.name for s in specs if s.alias_of is None}
    pending: dict[str, torch.Tensor] = {}

    def produce(spec: TensorSpec) -> torch.Tensor:
        while spec.name not in pending:
            name, tensor = next(named)
            if name in wanted:
                pending[name] = tensor
        return pending.pop(spec.name).to(spec.dtype)

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        if path.suffix == ".safetensors":
            write_safetensors_file(partial, order_aliases_after_sources(specs), produce, {"format": "pt"})
        else:
            write_torch_file(partial, specs, produce)
    except BaseException as exc:
        partial.unlink(missing_ok=True)  # inside a published checkpoint it would stay for good
        failure = write_failure(exc, "the 16-bit model", path, "save to another folder")
        if failure is exc:
            raise
        raise failure from exc
    for _ in named:  # the rest (non-persistent buffers) is gathered by the other ranks too
        pass
    os.replace(partial, path)
    shards.comm.barrier("16-bit model written")
    return path


def save_16bit_model(shards: ShardStore, module: nn.Module, enabled: bool, save_dir: str, save_filename: str) -> bool:
    """`engine.save_16bit_model`: write the file when `enabled` (the config key) and return True; otherwise
    say why nothing was written (rank 0) and return False, as DeepSpeed does."""
    path = Path(save_dir) / save_filename
    if not enabled:
        if shards.comm.rank == 0:
            print(
                f"infinity: did not save {path}: 'zero_optimization.stage3_gather_16bit_weights_on_model_save' is "
                "false (set it, or consolidate a checkpoint with `infinity consolidate`)",
                file=sys.stderr,
            )
        return False
    write_16bit_model(shards, module, path)
    return True
