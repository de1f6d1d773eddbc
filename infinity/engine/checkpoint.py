"""Sharded checkpoints in DeepSpeed's shape: one model-states and one optim-states file per rank.

`save_checkpoint(engine, dir, tag)` writes `dir/tag/` under a temporary name, with a manifest of
every file's size and SHA-256, fsyncs and renames it; rank 0 then points `dir/latest` at the tag,
after every rank has finished. A crash at any moment leaves the previous checkpoint loadable (a
re-save of an existing tag first moves the old folder aside, and loading finds it there).
`load_checkpoint` verifies the manifests before reading anything, so a missing, truncated or
corrupted file is reported by name and the engine's state is left untouched.

The model-states file also holds, per FlatParam, its slots (each parameter's fqn, every name it has in
the state dict, shape and offset) and the state dict's keys in order, so a checkpoint can be
consolidated into one plain state dict without the model (`infinity.engine.consolidate`).

Loading reads every rank's shard as a range of each FlatParam's full (concatenated) buffer, one
tensor piece at a time (`CheckpointFiles`). The same path reshards a checkpoint written by another
world size, when `zero_optimization.elastic_checkpoint` is true; otherwise that is refused.

The folder itself (staging, publication, manifests, verification, finding the newest good
checkpoint) is `infinity.engine.checkpoint_folder`'s.

Test hook: with `INFINITY_TEST_PAUSE_IN_SAVE=<seconds>` in the environment, every save sleeps that
long between writing the model-states file and the optim-states file, so a test can kill the
process in the middle of a save.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from infinity.engine.checkpoint_folder import (
    LATEST,
    MANIFEST,
    CheckpointError,
    begin_staging,
    list_checkpoints,
    model_file,
    newest_verified_checkpoint,
    optim_file,
    publish,
    read_manifest,
    resolve_folder,
    verify_checkpoint,
    verify_rank,
    write_file,
    write_text,
)
from infinity.engine.checkpoint_format import (
    FormatError,
    LazyTensor,
    TensorSpec,
    TorchFileReader,
)

if TYPE_CHECKING:
    from infinity.engine.engine import InfinityEngine

__all__ = [  # the folder-level names are re-exported: callers import them from here
    "LATEST",
    "MANIFEST",
    "OPTIM_STATES",
    "CheckpointError",
    "CheckpointFiles",
    "list_checkpoints",
    "load_checkpoint",
    "model_file",
    "newest_verified_checkpoint",
    "optim_file",
    "read_manifest",
    "resolve_folder",
    "save_checkpoint",
    "verify_checkpoint",
    "verify_rank",
]

FORMAT_VERSION = 2  # 2: model states carry "flats" (slot metadata) and "state_dict_keys"
PAUSE_ENV = "INFINITY_TEST_PAUSE_IN_SAVE"
OPTIM_STATES = ("master", "exp_avg", "exp_avg_sq")


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _pause_for_tests() -> None:
    seconds = os.environ.get(PAUSE_ENV)
    if seconds:
        time.sleep(float(seconds))


def _flat_metadata(engine: InfinityEngine) -> dict[str, Any]:
    """Per FlatParam: sizes, and each slot's fqn, every state-dict name of it (tied weights), shape, offset."""
    names: dict[int, list[str]] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {
        flat.name: {
            "numel": flat.numel,
            "shard_numel": flat.shard_numel,
            "dtype": str(flat.full.dtype).removeprefix("torch."),
            "trainable": flat.requires_grad,
            "slots": [
                {
                    "fqn": slot.fqn,
                    "names": names.get(id(p), [slot.fqn]),
                    "shape": list(slot.shape),
                    "offset": slot.offset,
                }
                for slot, p in zip(flat.slots, flat.params, strict=True)
            ],
        }
        for flat in engine.flats
    }


def save_checkpoint(
    engine: InfinityEngine, save_dir: str | os.PathLike, tag: str | None, client_state: dict, save_latest: bool = True
) -> Path:
    """Write this rank's shards and state; returns the checkpoint folder."""
    comm = engine.comm
    tag = tag or f"global_step{engine.global_steps}"
    root = Path(save_dir)
    final = root / tag
    staging = root / f".{tag}.tmp"
    if comm.rank == 0:
        begin_staging(root, staging)
    comm.barrier("checkpoint staging folder")
    # Shards are specs, read from their tier (NVMe included) one at a time while the file is written,
    # so a save holds one shard's state in host memory, not the rank's.
    flats = {f.name: f for f in engine.flats}
    model_states = {
        "format_version": FORMAT_VERSION,
        "world_size": comm.world_size,
        "param_shards": {name: TensorSpec(name, (f.shard_numel,), f.full.dtype) for name, f in flats.items()},
        "buffers": {k: v.cpu() for k, v in engine.module.named_buffers()},
        "flats": _flat_metadata(engine),
        "state_dict_keys": list(engine.module.state_dict(keep_vars=True)),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "rng": _rng_state(),
        "client_state": client_state,
    }
    files = {
        model_file(comm.rank): write_file(
            staging / model_file(comm.rank), model_states, lambda spec: engine.placement.read(flats[spec.name])
        )
    }
    _pause_for_tests()
    optim_states = {
        "format_version": FORMAT_VERSION,
        "world_size": comm.world_size,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
        "shards": {
            f.name: {
                **{kind: TensorSpec(f"{kind}/{f.name}", (f.shard_numel,), torch.float32) for kind in OPTIM_STATES},
                "step": s.step,
            }
            for f, s in engine.optimizer.shard_states.items()
        },
    }
    current: dict[str, Any] = {}  # the one shard whose optimizer state is in memory

    def optim_state(spec: TensorSpec) -> torch.Tensor:
        kind, _, name = spec.name.partition("/")
        if current.get("name") != name:
            current.clear()
            current.update(name=name, state=engine.optimizer.read_state(flats[name]))
        return current["state"][kind]

    files[optim_file(comm.rank)] = write_file(staging / optim_file(comm.rank), optim_states, optim_state)
    current.clear()
    manifest = {
        "format_version": FORMAT_VERSION,
        "world_size": comm.world_size,
        "rank": comm.rank,
        "global_steps": engine.global_steps,
        "files": files,
    }
    write_text(staging / MANIFEST.format(rank=comm.rank), json.dumps(manifest, indent=1))
    comm.barrier("checkpoint files written")
    if comm.rank == 0:
        publish(root, staging, final, tag, save_latest)
    comm.barrier("checkpoint published")
    return final


class CheckpointFiles:
    """The per-rank files of one checkpoint folder, opened lazily, read one tensor range at a time.

    `read_range(kind, flat, start, end)` returns elements [start, end) of a FlatParam's full buffer as the
    saving run laid it out (its ranks' shards concatenated), whatever world size reads it; elements past
    that buffer's end are padding and read as zeros. `kind` is "param" (compute-dtype weights) or one of
    OPTIM_STATES. Memory: only the requested range is read.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.world_size = read_manifest(folder, 0)["world_size"]
        self._readers: dict[tuple[str, int], TorchFileReader] = {}

    def reader(self, kind: str, rank: int) -> TorchFileReader:
        """The model-states (`kind` "model") or optim-states ("optim") file of `rank`."""
        key = (kind, rank)
        if key not in self._readers:
            name = model_file(rank) if kind == "model" else optim_file(rank)
            try:
                self._readers[key] = TorchFileReader(self.folder / name)
            except FormatError as exc:
                raise CheckpointError(f"checkpoint file '{self.folder / name}' cannot be read: {exc}") from exc
        return self._readers[key]

    def _shard(self, kind: str, rank: int, flat_name: str) -> LazyTensor:
        if kind == "param":
            return self.reader("model", rank).obj["param_shards"][flat_name]
        return self.reader("optim", rank).obj["shards"][flat_name][kind]

    def shard_numel(self, flat_name: str) -> int:
        return self._shard("param", 0, flat_name).numel

    def read_range(self, kind: str, flat_name: str, start: int, end: int) -> torch.Tensor:
        shard_numel = self.shard_numel(flat_name)
        saved_end = shard_numel * self.world_size
        dtype = self._shard(kind, 0, flat_name).dtype
        out = torch.empty(end - start, dtype=dtype)
        out[max(0, min(end, saved_end) - start) :] = 0  # past the saved buffer: padding
        pos = start
        while pos < min(end, saved_end):
            rank, offset = divmod(pos, shard_numel)
            n = min(end, (rank + 1) * shard_numel) - pos
            reader = self.reader("model" if kind == "param" else "optim", rank)
            try:
                reader.read_into(self._shard(kind, rank, flat_name), offset, out[pos - start : pos - start + n])
            except FormatError as exc:
                raise CheckpointError(str(exc)) from exc
            pos += n
        return out

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_checkpoint(
    engine: InfinityEngine,
    load_dir: str | os.PathLike,
    tag: str | None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[Path, dict]:
    """Restore every rank's shards and state from `load_dir/tag` (or the tag `latest` names).

    As in DeepSpeed: `load_module_only` restores the weights alone (fp32 masters included, so training
    continues from exactly them); `load_optimizer_states=False` keeps the engine's Adam moments and
    step counts; `load_lr_scheduler_states=False` keeps its schedule.
    """
    optimizer_too = load_optimizer_states and not load_module_only
    folder = resolve_folder(load_dir, tag)
    comm = engine.comm
    saved_world = int(read_manifest(folder, 0)["world_size"])
    if saved_world != comm.world_size and not engine.config.zero_optimization.elastic_checkpoint:
        raise CheckpointError(
            f"checkpoint '{folder}' was written by {saved_world} rank(s) and this run has {comm.world_size}; "
            f'resume with {saved_world} rank(s), or set "zero_optimization": {{"elastic_checkpoint": true}} '
            "to reshard it while loading"
        )
    needed = [comm.rank] if saved_world == comm.world_size else list(range(saved_world))
    for rank in needed:
        verify_rank(folder, rank, saved_world)
    with CheckpointFiles(folder) as files:
        source = comm.rank if comm.rank < saved_world else 0  # whose step counts, RNG and client state we take
        model_reader, optim_reader = files.reader("model", source), files.reader("optim", source)
        model_states, optim_states = model_reader.obj, optim_reader.obj
        _check_same_model(engine, folder, model_states)
        with torch.no_grad():
            for flat in engine.flats:
                start, end = flat.shard_range
                engine.placement.assign(flat, files.read_range("param", flat.name, start, end))
            for flat, state in engine.optimizer.shard_states.items():
                start, end = flat.shard_range
                if optimizer_too:
                    values = {kind: files.read_range(kind, flat.name, start, end) for kind in OPTIM_STATES}
                    engine.optimizer.load_state(flat, values)
                    state.step = optim_states["shards"][flat.name]["step"]
                else:
                    engine.optimizer.set_master(flat, files.read_range("master", flat.name, start, end))
            buffers = dict(engine.module.named_buffers())
            for key, value in model_states["buffers"].items():
                buffers[key].copy_(model_reader.load(value))
        client_state = model_reader.materialize(model_states["client_state"])
        if optimizer_too:
            for group, saved in zip(engine.optimizer.param_groups, optim_states["param_groups"], strict=True):
                group.update(saved)
            engine.optimizer.sync_step_counts()
        if not load_module_only:
            engine.global_steps = model_states["global_steps"]
            engine.micro_steps = model_states["micro_steps"]
            engine.loss_scaler.load_state_dict(model_states["loss_scaler"])
            _set_rng_state(model_reader.materialize(model_states["rng"]))
        if load_lr_scheduler_states and not load_module_only and engine.lr_scheduler is not None:
            if model_states["lr_scheduler"] is not None:
                engine.lr_scheduler.load_state_dict(model_states["lr_scheduler"])
    engine.persistent.release()  # re-gathered from the restored shards at the next forward
    return folder, client_state


def _check_same_model(engine: InfinityEngine, folder: Path, model_states: dict[str, Any]) -> None:
    names = {f.name for f in engine.flats}
    if set(model_states["param_shards"]) != names:
        raise CheckpointError(f"checkpoint '{folder}' holds a different model: its blocks do not match this engine's")
    for flat in engine.flats:
        saved = model_states.get("flats", {}).get(flat.name)
        if saved is not None and saved["numel"] != flat.numel:
            raise CheckpointError(
                f"checkpoint '{folder}' holds a different model: block '{flat.name}' has {saved['numel']} "
                f"parameters there and {flat.numel} here"
            )
