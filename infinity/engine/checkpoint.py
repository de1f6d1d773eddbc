"""Sharded checkpoints in DeepSpeed's shape: one model-states and one optim-states file per rank.

`save_checkpoint(dir, tag, shards, module, run_state, ...)` writes `dir/tag/` under a temporary name, with a manifest of
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from infinity.engine.checkpoint_errors import CheckpointError, RunMismatch
from infinity.engine.checkpoint_files import CheckpointFiles
from infinity.engine.checkpoint_folder import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    begin_staging,
    check_tag,
    list_checkpoints,
    model_file,
    newest_verified_checkpoint,
    optim_file,
    publish,
    read_manifest,
    resolve_folder,
    seal_manifest,
    verify_checkpoint,
    verify_rank,
    write_file,
    write_text,
)
from infinity.models.weight_files import TensorSpec
from infinity.shards.moments import moment_format
from infinity.shards.store import ShardKind, ShardStore

__all__ = [  # the folder-level names are re-exported: callers import them from here
    "LATEST",
    "MANIFEST",
    "OPTIM_STATES",
    "CheckpointError",
    "CheckpointFiles",
    "RunMismatch",
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

PAUSE_ENV = "INFINITY_TEST_PAUSE_IN_SAVE"
# The optimizer state of a shard in fp32 moments; other moment formats store their own tensors in place of
# the moments (`shards.moments`: bf16 codes; 8-bit codes and per-block scales), named in "moments".
OPTIM_STATES = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class RunState:
    """What a checkpoint holds of the run besides the shards: counters, loss scale, schedule, hyper-parameters."""

    global_steps: int
    micro_steps: int
    loss_scaler: dict[str, Any]
    lr_scheduler: dict[str, Any] | None
    param_groups: list[dict[str, Any]]


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


def _names_by_param(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _slot_steps(record) -> dict[str, list[int]]:
    """A shard's per-parameter step counts where some parameters skipped steps (`optim.param_steps`)."""
    return {} if record.slot_steps is None else {"slot_steps": list(record.slot_steps)}


def _flat_metadata(shards: ShardStore, module: nn.Module) -> dict[str, Any]:
    """Per FlatParam: sizes, and each slot's fqn, every state-dict name of it (tied weights), shape, offset."""
    names = _names_by_param(module)
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
        for flat in shards.flats
    }


def save_checkpoint(
    save_dir: str | os.PathLike,
    tag: str,
    shards: ShardStore,
    module: nn.Module,
    run: RunState,
    client_state: dict,
    save_latest: bool = True,
) -> Path:
    """Write this rank's shards (read from `shards`) and `run`; returns the checkpoint folder."""
    comm = shards.comm
    root = Path(save_dir)
    check_tag(root, tag)
    final = root / tag
    staging = root / f".{tag}.tmp"
    if comm.rank == 0:
        begin_staging(root, staging, holder=shards)  # the engine's store: released by engine.close()
    comm.barrier("checkpoint staging folder")
    # Shards are specs, read from their tier (NVMe included) one at a time while the file is written,
    # so a save holds one shard's state in host memory, not the rank's.
    flats = {f.name: f for f in shards.flats}
    model_states = {
        "format_version": FORMAT_VERSION,
        "world_size": comm.world_size,
        "param_shards": {name: TensorSpec(name, (f.shard_numel,), f.full.dtype) for name, f in flats.items()},
        "buffers": {k: v.cpu() for k, v in module.named_buffers()},
        "flats": _flat_metadata(shards, module),
        "state_dict_keys": list(module.state_dict(keep_vars=True)),
        "global_steps": run.global_steps,
        "micro_steps": run.micro_steps,
        "loss_scaler": run.loss_scaler,
        "lr_scheduler": run.lr_scheduler,
        "rng": _rng_state(),
        "client_state": client_state,
    }
    files = {
        model_file(comm.rank): write_file(
            staging / model_file(comm.rank),
            model_states,
            lambda spec: shards.read(flats[spec.name], ShardKind.PARAM),
        )
    }
    _pause_for_tests()
    fmt = moment_format(shards.placement.moments)

    def shard_specs(f) -> dict[str, TensorSpec]:
        specs = {"master": (torch.float32, f.shard_numel), **fmt.tensor_specs(f.shard_numel)}
        return {kind: TensorSpec(f"{kind}/{f.name}", (count,), dtype) for kind, (dtype, count) in specs.items()}

    optim_states = {
        "format_version": FORMAT_VERSION,
        "world_size": comm.world_size,
        "param_groups": run.param_groups,
        "shards": {
            f.name: {**shard_specs(f), "step": record.step, "moments": fmt.name, **_slot_steps(record)}
            for f, record in shards.records.items()
        },
    }
    current: dict[str, Any] = {}  # the one shard whose moments are in memory

    def optim_state(spec: TensorSpec) -> torch.Tensor:
        kind, _, name = spec.name.partition("/")
        if kind == "master":
            return shards.read(flats[name], ShardKind.MASTER)
        if current.get("name") != name:
            current.clear()
            current.update(name=name, moments=shards.read_moments(flats[name]))
        return current["moments"][kind]

    files[optim_file(comm.rank)] = write_file(staging / optim_file(comm.rank), optim_states, optim_state)
    current.clear()
    manifest = {
        "format_version": FORMAT_VERSION,
        "world_size": comm.world_size,
        "rank": comm.rank,
        "global_steps": run.global_steps,
        "files": files,
    }
    write_text(staging / MANIFEST.format(rank=comm.rank), json.dumps(seal_manifest(manifest), indent=1))
    comm.barrier("checkpoint files written")
    if comm.rank == 0:
        publish(root, staging, final, tag, save_latest)
    comm.barrier("checkpoint published")
    return final


def load_checkpoint(
    load_dir: str | os.PathLike,
    tag: str | None,
    shards: ShardStore,
    module: nn.Module,
    optimizer_too: bool = True,
    restore_rng: bool = True,
    elastic: bool = False,
) -> tuple[Path, dict, RunState]:
    """Restore every rank's shards (into `shards`) and buffers (into `module`) from `load_dir/tag` (or the
    tag `latest` names), and with `restore_rng` the RNG states; returns (the folder, the client state, the
    saved RunState) for the caller to apply.

    As in DeepSpeed: without `optimizer_too` the weights alone are restored (fp32 masters included, so
    training continues from exactly them) and the store keeps its Adam moments and step counts. A
    checkpoint of another world size is resharded while loading when `elastic`, refused otherwise.
    """
    folder = resolve_folder(load_dir, tag)
    comm = shards.comm
    saved_world = int(read_manifest(folder, 0)["world_size"])
    if saved_world != comm.world_size and not elastic:
        raise RunMismatch(
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
        _check_same_model(shards, folder, model_states)
        _check_same_buffers(module, folder, model_states)
        with torch.no_grad():
            for flat in shards.flats:
                start, end = flat.shard_range
                if flat not in shards.records:  # frozen: the compute-dtype shard is all there is
                    shards.assign_param(flat, files.read_range("param", flat.name, start, end))
                    continue
                master = files.read_range("master", flat.name, start, end)
                if optimizer_too:
                    moments = files.shard_moments(flat.name, start, end)
                    saved = optim_states["shards"][flat.name]
                    shards.assign(flat, master, moments, step=saved["step"], slot_steps=saved.get("slot_steps"))
                else:
                    shards.assign(flat, master)
            for flat in shards.flats:
                shards.sync_resident(flat)
            buffers = dict(module.named_buffers())
            for key, value in model_states["buffers"].items():
                if key in buffers and tuple(buffers[key].shape) == tuple(value.shape):  # see _check_same_buffers
                    buffers[key].copy_(model_reader.load(value))
        client_state = model_reader.materialize(model_states["client_state"])
        saved = RunState(
            global_steps=model_states["global_steps"],
            micro_steps=model_states["micro_steps"],
            loss_scaler=model_states["loss_scaler"],
            lr_scheduler=model_states["lr_scheduler"],
            param_groups=optim_states["param_groups"],
        )
        if restore_rng:
            _set_rng_state(model_reader.materialize(model_states["rng"]))
    return folder, client_state, saved


def _persistent_buffers(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shapes of `module`'s buffers that its state_dict holds (not those registered persistent=False)."""
    return {
        f"{prefix}.{name}" if prefix else name: tuple(b.shape)
        for prefix, m in module.named_modules()
        for name, b in m._buffers.items()
        if b is not None and name not in m._non_persistent_buffers_set
    }


def _check_same_buffers(module: nn.Module, folder: Path, model_states: dict[str, Any]) -> None:
    """RunMismatch naming a state_dict buffer the checkpoint and the module do not share, or share in another
    shape, before anything is assigned (found after the weights, it left a model half loaded). Non-persistent
    buffers (position ids, caches) are loaded where name and shape match, and otherwise keep their values."""
    ours = _persistent_buffers(module)
    theirs = {name: tuple(t.shape) for name, t in model_states.get("buffers", {}).items()}
    keys = set(model_states.get("state_dict_keys", theirs))  # the saved module's state_dict
    for name in sorted(set(ours) | (set(theirs) & keys)):
        if ours.get(name) != theirs.get(name):
            where = (
                "is not in this model" if name not in ours
                else "is not in the checkpoint" if name not in theirs
                else f"has shape {list(theirs[name])} there and {list(ours[name])} here"
            )  # fmt: skip
            raise RunMismatch(f"checkpoint '{folder}' holds a different model: buffer '{name}' {where}; {_ACROSS}")


_ACROSS = "to carry its weights across, write them out with `infinity consolidate`, then engine.load_full_state"


def _check_same_model(shards: ShardStore, folder: Path, model_states: dict[str, Any]) -> None:
    names = {f.name for f in shards.flats}
    saved_names = set(model_states["param_shards"])
    if saved_names != names:
        theirs, ours = sorted(saved_names - names)[:2], sorted(names - saved_names)[:2]
        differ = [f"its shards {theirs} are not this engine's" if theirs else "",
                  f"this engine's {ours} are not there" if ours else ""]  # fmt: skip
        raise RunMismatch(
            f"checkpoint '{folder}' holds a different model, or this model with other param groups, frozen "
            f"parameters or block_classes ({', and '.join(d for d in differ if d)}); {_ACROSS}"
        )
    for flat in shards.flats:
        saved = model_states.get("flats", {}).get(flat.name)
        if saved is not None and saved["numel"] != flat.numel:
            raise RunMismatch(
                f"checkpoint '{folder}' holds a different model: block '{flat.name}' has {saved['numel']} "
                f"parameters there and {flat.numel} here; {_ACROSS}"
            )
