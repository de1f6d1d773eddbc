"""`infinity train --resume`: which checkpoint to continue from, decided alike on every rank.

`latest` (or `--resume-tag TAG`) names the checkpoint. If it is missing, empty or damaged on any rank,
the newest checkpoint whose files all verify is offered by name in the one-line error, or taken with
`--resume-fallback`; a staging folder of an unfinished save never is.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from infinity.engine.checkpoint import (
    CheckpointError,
    RunMismatch,
    list_checkpoints,
    newest_verified_checkpoint,
    resolve_folder,
)


def _failed_on_any_rank(engine, failed: bool) -> bool:
    flag = torch.tensor([1.0 if failed else 0.0])
    engine.comm.all_reduce(flag, "whether every rank could load the checkpoint", op="max")
    return bool(flag.item())


def _load(engine, folder: Path) -> dict[str, Any]:
    _, client = engine.load_checkpoint(str(folder.parent), tag=folder.name)
    return client


def resume(engine, save_dir: str, tag: str | None, fallback: bool, say: Callable[[str], None]) -> tuple[str, dict]:
    """Load the checkpoint to resume from into `engine`: `tag`'s, or `latest`'s; (its name, its client state).

    CheckpointError, naming the problem and the newest complete checkpoint (if any), when that one cannot
    be loaded on some rank and `fallback` is false; with `fallback`, the newest complete one is loaded.
    """
    folder: Path | None = None
    problem: CheckpointError | None = None
    client: dict[str, Any] = {}
    try:
        folder = resolve_folder(save_dir, tag, tag_hint="")  # what to do follows below
        client = _load(engine, folder)  # verifies this rank's files before touching any state
    except CheckpointError as exc:
        problem = exc
    if not _failed_on_any_rank(engine, problem is not None):
        return tag or folder.name, client
    if isinstance(problem, RunMismatch):  # the whole run's checkpoints are of that other run: none would do
        other_model = "holds a different model" in str(problem)
        sized = " (--model sizes the model, and --seq a GPT preset's position table)" if other_model else ""
        raise CheckpointError(f"cannot resume from '{save_dir}': {problem}{sized}")
    reason = str(problem) if problem is not None else f"another rank could not load '{folder}' (its line says why)"
    found = newest_verified_checkpoint(save_dir, exclude=[folder] if folder is not None else [])
    if found is None:
        fresh = "another --save-dir (or move these away)" if list_checkpoints(save_dir) else "without --resume"
        raise CheckpointError(
            f"cannot resume from '{save_dir}': {reason}; no {'other ' if folder else ''}checkpoint there is complete: "
            f"train {fresh} to start over"
        )
    newest, newest_folder = found
    if not fallback:
        raise CheckpointError(
            f"cannot resume from '{save_dir}': {reason}; the newest complete checkpoint there is '{newest}': "
            f"resume from it with --resume-tag {newest} (or add --resume-fallback)"
        )
    say(f"cannot resume from the checkpoint named: {reason}; resuming from the newest complete one, '{newest}'")
    return newest, _load(engine, newest_folder)


def resume_run(engine, data, args: argparse.Namespace, say: Callable[[str], None]) -> str:
    """`infinity train --resume` / `--resume-tag`: load the checkpoint (`resume`) and the batch stream's position
    into `data`; its name. A new --lr is not applied (the checkpoint's schedule continues): a note says so."""
    tag, client = resume(engine, args.save_dir, args.resume_tag, args.resume_fallback, say)
    if "data" not in client:
        raise CheckpointError(
            f"checkpoint '{tag}' in '{args.save_dir}' was not written by `infinity train` (it has no batch-stream "
            "position); load it with engine.load_checkpoint in your own loop"
        )
    try:
        data.load_state_dict(client["data"])
    except ValueError as exc:
        raise CheckpointError(
            f"checkpoint '{tag}' in '{args.save_dir}' was written by a run with another batch stream: {exc}; "
            "resume with the same --model, --data, --seq, --seed and global batch (train_micro_batch_size_per_gpu x "
            "gradient_accumulation_steps x ranks; at another number of ranks, with elastic_checkpoint, change the "
            "micro batch so that the product stays)"
        ) from exc
    saved_lrs = getattr(engine.lr_scheduler, "base_lrs", None)
    if getattr(args, "lr", None) is not None and saved_lrs and not math.isclose(saved_lrs[0], args.lr):
        say(f"note: --lr {args.lr:g} is not applied on resume: the checkpoint's schedule continues (peak lr "
            f"{saved_lrs[0]:g}), as in DeepSpeed; start a new run to change it")  # fmt: skip
    return tag
