"""Checks `infinity train` makes before building anything: the NVMe folders and the host memory budget.

Each failure is a one-line error naming the flag or config key, the value and what to do, so that a
mistake costs seconds, not a model build.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from infinity.cli.faults import CommandError, ExitCode
from infinity.config import ConfigError, InfinityConfig
from infinity.config.sizes import ITEMSIZE


def _unwritable(folder: Path) -> str:
    """Why files cannot be created in `folder`, or ''."""
    if not folder.is_dir():
        return "is a file, not a folder"
    if os.access(folder, os.W_OK | os.X_OK):
        return ""
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return "is on a read-only filesystem"
    return "is not writable by this user"


def write_problem(path: Path, folder: bool) -> str:
    """Why a folder (`folder`) or a file could not be written at `path`, the missing folders on the way made;
    '' if it could. Nothing is created."""
    target = path.absolute()
    if target.exists() and target.is_dir() != folder:
        return "is a folder, not a file" if target.is_dir() else "is a file, not a folder"
    existing = next(p for p in (target, *target.parents) if p.exists())
    if existing != target and not existing.is_dir():
        return f"cannot be made: '{existing}' is a file, not a folder"
    writable_in = existing if existing.is_dir() else existing.parent
    why = _unwritable(writable_in)
    return f"cannot be written: '{writable_in}' {why}" if why else ""


def prepare_nvme_folders(cfg: InfinityConfig, from_flag: bool) -> None:
    """Create each NVMe offload folder that is missing; refuse one that is a file or cannot be written."""
    z = cfg.zero_optimization
    for name, section in (("offload_param", z.offload_param), ("offload_optimizer", z.offload_optimizer)):
        if section.device != "nvme":
            continue
        what = "--nvme-path" if from_flag else f"'zero_optimization.{name}.nvme_path'"
        path = Path(section.nvme_path)
        if path.exists() and not path.is_dir():
            raise CommandError(
                ExitCode.PATH,
                f"{what} '{path}' is a file, not a folder: name a folder for the swap files (it is created if missing)",
            )
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            code = ExitCode.DISK_FULL if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ExitCode.PATH
            raise CommandError(
                code, f"{what} '{path}' cannot be created: {exc.strerror or exc}; choose a folder you can write"
            ) from exc
        why = _unwritable(path)
        if why:
            raise CommandError(ExitCode.PATH, f"{what} '{path}' {why}: choose a writable folder for the swap files")


SAVE_DIR_HOLDER = "infinity train"  # the command's hold on --save-dir, let go when the command ends


def check_save_dir(save_dir: str, resuming: bool) -> None:
    """Refuse a --save-dir that is a file, that checkpoints could not be written to, that holds an earlier
    run's checkpoints when this run starts afresh (its saves would replace them), or that another live run
    saves into (rank 0 creates it and takes its writer lock now, not at the first save), before training."""
    from infinity.engine.checkpoint_folder import list_checkpoints
    from infinity.engine.save_dir_lock import hold_save_dir

    path = Path(save_dir)
    if path.exists() and not path.is_dir():
        raise CommandError(ExitCode.PATH, f"--save-dir '{path}' is a file, not a folder: name a folder for checkpoints")
    existing = next((p for p in (path, *path.absolute().parents) if p.exists()), None)
    why = _unwritable(existing) if existing is not None else ""
    if why:
        where = "" if existing == path else f" (its existing parent '{existing}' {why})"
        raise CommandError(
            ExitCode.PATH,
            f"--save-dir '{path}' {why if not where else 'cannot be created'}{where}: choose a writable folder",
        )
    if os.environ.get("RANK", "0") == "0":  # before training, not at its first save (an empty folder is nothing)
        hold_save_dir(path, SAVE_DIR_HOLDER)
    earlier = list_checkpoints(path)
    if earlier and not resuming:
        raise ConfigError(
            f"--save-dir '{path}' holds checkpoints of an earlier run ({', '.join(earlier[-3:])}); a new run would "
            "replace them and move 'latest': add --resume to continue that run, or choose another --save-dir"
        )


def check_host_budget(cfg: InfinityConfig, model_name: str, block_size: int, world_size: int) -> None:
    """Refuse a `host_budget_bytes` smaller than the model states the config keeps in host memory.

    Only the "cpu" offloads are checked here: with both offloads on NVMe the engine's budget plan
    checks the staging it needs when it starts.
    """
    from infinity.estimator import format_bytes, gpt_model_size, host_resident_bytes

    z = cfg.zero_optimization
    budget = z.host_budget_bytes
    param, optim = z.offload_param.device, z.offload_optimizer.device
    if budget is None or "cpu" not in (param, optim):
        return
    if z.stage not in (1, 2, 3) or (z.stage < 3 and param != "none"):
        return  # the engine refuses these, naming the fix
    import torch

    size = gpt_model_size(model_name, zero=z, block_size=block_size)
    need = host_resident_bytes(
        size,
        param,
        optim,
        world_size,
        ITEMSIZE[cfg.compute_dtype_name],
        stage=z.stage,
        moments=z.offload_optimizer.moments,  # clipping and accumulation change NVMe slots only
        device_is_host=not torch.cuda.is_available(),
    )
    if budget < need:
        raise ConfigError(
            f"'zero_optimization.host_budget_bytes' is {budget} ({format_bytes(budget)}), but with offload_param on "
            f'"{param}" and offload_optimizer on "{optim}" the model states kept in host memory need {need} bytes '
            f"({format_bytes(need)}) per rank for GPT '{model_name}' on {world_size} rank(s): raise it to at least "
            f'{need}, or offload to "nvme"'
        )
