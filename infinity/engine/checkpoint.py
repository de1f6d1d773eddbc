"""Sharded checkpoints in DeepSpeed's shape: one model-states and one optim-states file per rank.

`save_checkpoint(engine, dir, tag)` writes `dir/tag/` under a temporary name, with a manifest of
every file's size and SHA-256, fsyncs and renames it; rank 0 then points `dir/latest` at the tag,
after every rank has finished. A crash at any moment leaves the previous checkpoint loadable.
`load_checkpoint` verifies the manifest before reading anything, so a missing, truncated or
corrupted file is reported by name and the engine's state is left untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from infinity.engine.engine import InfinityEngine

FORMAT_VERSION = 1
MANIFEST = "manifest_rank{rank}.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged or was written by an incompatible run."""


def _model_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def _optim_file(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, obj: Any) -> dict[str, Any]:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


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


def save_checkpoint(engine: InfinityEngine, save_dir: str | os.PathLike, tag: str | None, client_state: dict) -> Path:
    """Write this rank's shards and state; returns the checkpoint folder."""
    comm = engine.comm
    tag = tag or f"global_step{engine.global_steps}"
    root = Path(save_dir)
    final = root / tag
    staging = root / f".{tag}.tmp"
    if comm.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    comm.barrier("checkpoint staging folder")
    model_states = {
        "format_version": FORMAT_VERSION,
        "world_size": comm.world_size,
        "param_shards": {f.name: engine.placement.home(f).cpu() for f in engine.flats},
        "buffers": {k: v.cpu() for k, v in engine.module.named_buffers()},
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "loss_scaler": engine.loss_scaler.state_dict(),
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "rng": _rng_state(),
        "client_state": client_state,
    }
    optim_states = {
        "format_version": FORMAT_VERSION,
        "world_size": comm.world_size,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
        "shards": {
            f.name: {
                "master": s.master.cpu(),
                "exp_avg": s.exp_avg.cpu(),
                "exp_avg_sq": s.exp_avg_sq.cpu(),
                "step": s.step,
            }
            for f, s in engine.optimizer.shard_states.items()
        },
    }
    files = {
        _model_file(comm.rank): _write(staging / _model_file(comm.rank), model_states),
        _optim_file(comm.rank): _write(staging / _optim_file(comm.rank), optim_states),
    }
    manifest = {"format_version": FORMAT_VERSION, "world_size": comm.world_size, "rank": comm.rank, "files": files}
    (staging / MANIFEST.format(rank=comm.rank)).write_text(json.dumps(manifest, indent=1))
    comm.barrier("checkpoint files written")
    if comm.rank == 0:
        _fsync_dir(staging)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(tag)
        with latest_tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(latest_tmp, root / "latest")
        _fsync_dir(root)
    comm.barrier("checkpoint published")
    return final


def _verify(folder: Path, rank: int, world_size: int) -> None:
    manifest_path = folder / MANIFEST.format(rank=rank)
    if not manifest_path.is_file():
        raise CheckpointError(
            f"checkpoint '{folder}' has no {manifest_path.name}: it is incomplete or not a checkpoint"
        )
    manifest = json.loads(manifest_path.read_text())
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"checkpoint '{folder}' was written by {manifest['world_size']} rank(s) and this run has {world_size}; "
            f"resharding is not supported yet: resume with {manifest['world_size']} rank(s)"
        )
    for name, expect in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file '{path}' is missing")
        size = path.stat().st_size
        if size != expect["bytes"]:
            raise CheckpointError(
                f"checkpoint file '{path}' is truncated: {size} bytes, the manifest says {expect['bytes']}"
            )
        if _sha256(path) != expect["sha256"]:
            raise CheckpointError(f"checkpoint file '{path}' is corrupted: its SHA-256 differs from the manifest's")


def load_checkpoint(engine: InfinityEngine, load_dir: str | os.PathLike, tag: str | None) -> tuple[Path, dict]:
    """Restore every rank's shards and state from `load_dir/tag` (or the tag `latest` names)."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise CheckpointError(f"'{root}' has no 'latest' file; pass tag= to name the checkpoint to load")
        tag = latest.read_text().strip()
    folder = root / tag
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint '{folder}' does not exist")
    comm = engine.comm
    _verify(folder, comm.rank, comm.world_size)
    model_states = torch.load(folder / _model_file(comm.rank), weights_only=False)
    optim_states = torch.load(folder / _optim_file(comm.rank), weights_only=False)
    names = {f.name for f in engine.flats}
    if set(model_states["param_shards"]) != names:
        raise CheckpointError(f"checkpoint '{folder}' holds a different model: its blocks do not match this engine's")
    with torch.no_grad():
        for flat in engine.flats:
            engine.placement.home(flat).copy_(model_states["param_shards"][flat.name])
        for flat, state in engine.optimizer.shard_states.items():
            saved = optim_states["shards"][flat.name]
            state.master.copy_(saved["master"])
            state.exp_avg.copy_(saved["exp_avg"])
            state.exp_avg_sq.copy_(saved["exp_avg_sq"])
            state.step = saved["step"]
        buffers = dict(engine.module.named_buffers())
        for key, value in model_states["buffers"].items():
            buffers[key].copy_(value)
    for group, saved in zip(engine.optimizer.param_groups, optim_states["param_groups"], strict=True):
        group.update(saved)
    engine.optimizer.sync_step_counts()
    engine.global_steps = model_states["global_steps"]
    engine.micro_steps = model_states["micro_steps"]
    engine.loss_scaler.load_state_dict(model_states["loss_scaler"])
    if engine.lr_scheduler is not None and model_states["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(model_states["lr_scheduler"])
    _set_rng_state(model_states["rng"])
    engine.persistent.release()  # re-gathered from the restored shards at the next forward
    return folder, model_states["client_state"]
