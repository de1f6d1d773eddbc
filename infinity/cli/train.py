"""`infinity train`: the default job trains the small GPT on the bundled corpus with ZeRO-3 and NVMe offload.

`--model FOLDER --data FILE` trains a Hugging Face model on the user's text instead (`cli.jobs`), and
`--save-hf DIR` writes the result back as a Hugging Face folder. Every flag overrides the embedded
default; `--config` replaces the default config with a DeepSpeed JSON file whose "auto" values are
filled from these arguments, as Hugging Face's Trainer fills them.
Under `torchrun` every rank trains its slice of each batch; rank 0 prints and the checkpoint is sharded.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from infinity.config import AutoValues, ConfigError, InfinityConfig, load_config, resolve_auto
from infinity.engine.host_memory import reexec_with_huge_pages
from infinity.models.gpt import GPT_PRESETS

DEFAULT_MODEL = "small"
DEFAULT_STEPS = 300
DEFAULT_SEQ = 64
DEFAULT_SAVE_DIR = "runs/default"
DEFAULT_NVME_PATH = "./nvme"
LR = 3e-3
LR_PRETRAINED = 2e-5  # fine-tuning a pretrained Hugging Face model
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
MAX_GRAD_NORM = 1.0
MICRO_BATCH = 8

DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": MAX_GRAD_NORM,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY}},
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {
            "total_num_steps": "auto",
            "warmup_num_steps": "auto",
            "warmup_type": "linear",
            "cos_min_ratio": 0.1,
        },
    },
    "zero_optimization": {
        "stage": 3,
        "block_classes": ["Block"],
        # DeepSpeed's default (1e5) would keep every weight of the small presets whole on every rank: lower, so
        # that the job shards, gathers and prefetches its layers' weights block by block, as a large model does
        "stage3_param_persistence_threshold": 10_000,
        "offload_param": {"device": "nvme", "nvme_path": DEFAULT_NVME_PATH},
        "offload_optimizer": {"device": "nvme", "nvme_path": DEFAULT_NVME_PATH},
    },
    "steps_per_print": 25,
}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from infinity.cli.arg_types import positive_int, seed

    parser.add_argument("--config", help="a DeepSpeed-style JSON config (default: the embedded one)")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"a GPT preset ({', '.join(GPT_PRESETS)}; default: small) or a Hugging Face model folder",
    )
    parser.add_argument("--data", help="text to train on: a plain text or JSON lines file (default: bundled corpus)")
    parser.add_argument("--save-hf", help="also write the trained model as a Hugging Face folder DIR (--model FOLDER)")
    parser.add_argument("--lr", type=float, help=f"peak learning rate (default: {LR}, {LR_PRETRAINED} for a folder)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps in total (resume included)")
    parser.add_argument(
        "--seq", type=positive_int, help=f"tokens per sequence (default: {DEFAULT_SEQ}, at most the preset's)"
    )
    parser.add_argument("--save-dir", default=DEFAULT_SAVE_DIR, help="where checkpoints are written")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    parser.add_argument("--resume-tag", metavar="TAG", help="continue from the checkpoint TAG in --save-dir")
    parser.add_argument(
        "--resume-fallback",
        action="store_true",
        help="with --resume: if the named checkpoint is missing or damaged, take the newest one that verifies",
    )
    parser.add_argument("--nvme-path", help=f"folder for NVMe offload (default: {DEFAULT_NVME_PATH})")
    parser.add_argument(
        "--offload", choices=("none", "cpu", "nvme"), help="override offload_param and offload_optimizer devices"
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="compute dtype (default: the config's)")
    parser.add_argument("--seed", type=seed, default=1234, help="random seed, in [0, 2**63 - 1] (default: 1234)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="record swap traces into <save-dir>/profile (read them: infinity profile)",
    )


# -- the config --------------------------------------------------------------------------------


def auto_values(args: argparse.Namespace) -> AutoValues:
    """What "auto" means for this run: the CLI's arguments and defaults, in TrainingArguments' roles."""
    return AutoValues(
        micro_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=1,
        learning_rate=_lr(args),
        adam_betas=BETAS,
        adam_epsilon=1e-8,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM,
        warmup_steps=max(1, args.steps // 10),
        total_steps=args.steps,
        fp16=args.dtype == "fp16",
        bf16=args.dtype == "bf16",
    )


def _lr(args: argparse.Namespace) -> float:
    if getattr(args, "lr", None) is not None:
        return args.lr
    return LR if getattr(args, "model", DEFAULT_MODEL) in GPT_PRESETS else LR_PRETRAINED


def _with_lr(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The embedded config with --lr (or a pretrained model's default) as the optimizer's lr."""
    raw["optimizer"]["params"]["lr"] = _lr(args)
    return raw


def _with_peak_lr(cfg: InfinityConfig, lr: float) -> InfinityConfig:
    """A config file's optimizer lr, and its schedule's peak (`warmup_max_lr`) where it names one, set to --lr:
    the flag overrides the file as --offload and --dtype do (it only filled an "auto" lr, silently otherwise)."""
    updates: dict[str, Any] = {}
    if cfg.optimizer is not None:
        updates["optimizer"] = dataclasses.replace(cfg.optimizer, params={**cfg.optimizer.params, "lr": lr})
    if cfg.scheduler is not None and "warmup_max_lr" in cfg.scheduler.params:
        updates["scheduler"] = dataclasses.replace(
            cfg.scheduler, params={**cfg.scheduler.params, "warmup_max_lr": lr}
        )
    return dataclasses.replace(cfg, **updates)


def _with_block_classes(cfg: InfinityConfig, classes: tuple[str, ...] | None, from_file: bool) -> InfinityConfig:
    """A model's own layer classes as its blocks, unless a config file names some."""
    if classes is None or (from_file and cfg.zero_optimization.block_classes):
        return cfg
    return dataclasses.replace(cfg, zero_optimization=dataclasses.replace(cfg.zero_optimization, block_classes=classes))


def _with_offload(cfg: InfinityConfig, device: str | None, nvme_path: str | None) -> InfinityConfig:
    z = cfg.zero_optimization
    param, optim = z.offload_param, z.offload_optimizer
    if device is not None:
        param, optim = dataclasses.replace(param, device=device), dataclasses.replace(optim, device=device)
        if device != "nvme" and nvme_path is None:  # the folder the config named means nothing off NVMe
            param, optim = dataclasses.replace(param, nvme_path=None), dataclasses.replace(optim, nvme_path=None)
    if nvme_path is not None:
        param, optim = dataclasses.replace(param, nvme_path=nvme_path), dataclasses.replace(optim, nvme_path=nvme_path)
    for section, name in ((param, "offload_param"), (optim, "offload_optimizer")):
        if section.device == "nvme" and not section.nvme_path:
            raise ConfigError(
                f"'zero_optimization.{name}.device' is \"nvme\" but '{name}.nvme_path' is not set; "
                "set it in the config or pass --nvme-path"
            )
    z = dataclasses.replace(z, offload_param=param, offload_optimizer=optim)
    return dataclasses.replace(cfg, zero_optimization=z)


def _with_dtype(cfg: InfinityConfig, dtype: str | None) -> InfinityConfig:
    if dtype is None:
        return cfg
    return dataclasses.replace(
        cfg,
        bf16=dataclasses.replace(cfg.bf16, enabled=dtype == "bf16"),
        fp16=dataclasses.replace(cfg.fp16, enabled=dtype == "fp16"),
    )


def profile_path(args: argparse.Namespace) -> Path:
    """Where `--profile` writes the swap traces: <save-dir>/profile."""
    return Path(args.save_dir) / "profile"


def _with_profile(cfg: InfinityConfig, args: argparse.Namespace) -> InfinityConfig:
    if not getattr(args, "profile", False):
        return cfg
    return dataclasses.replace(
        cfg, profiler=dataclasses.replace(cfg.profiler, enabled=True, path=str(profile_path(args)))
    )


def build_config(
    args: argparse.Namespace, hidden_size: int | None, block_classes: tuple[str, ...] | None = None
) -> InfinityConfig:
    """The run's config: --config (or the default), --offload / --nvme-path / --dtype / --profile, "auto" resolved;
    `block_classes` (a model's own layers) replace the default's unless --config names some."""
    raw = args.config if args.config else _with_lr(copy.deepcopy(DEFAULT_CONFIG), args)
    cfg = _with_block_classes(load_config(raw), block_classes, from_file=bool(args.config))
    if args.config and getattr(args, "lr", None) is not None:
        cfg = _with_peak_lr(cfg, args.lr)
    cfg = _with_profile(_with_dtype(_with_offload(cfg, args.offload, args.nvme_path), args.dtype), args)
    return resolve_auto(cfg, hidden_size, auto_values(args))


# -- the job -----------------------------------------------------------------------------------


def _mean_over_ranks(engine, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=engine.comm.device)  # NCCL reduces GPU tensors only
    if engine.comm.world_size > 1:
        engine.comm.all_reduce(t, "loss for the progress display")
        t /= engine.comm.world_size
    return t.item()


def _join_and_watch_peers(config: InfinityConfig):
    """Join the process group (torchrun's environment) and start the heartbeat that ends the run when a
    peer stops; the Heartbeat, or None with one rank or the heartbeat off."""
    from infinity.cli.faults import on_peer_silent
    from infinity.comm import init_distributed, start_heartbeat

    z = config.zero_optimization
    rank, world = init_distributed(torch.device("cuda" if torch.cuda.is_available() else "cpu"), z.comm_timeout_s)
    return start_heartbeat(rank, world, z.heartbeat_timeout_s, on_peer_silent("train"))


def _start(args: argparse.Namespace):
    """Build the model, config, engine and batches; returns (engine, the model choice, batches, heartbeat)."""
    import infinity
    from infinity.cli.jobs import check_hf_output, choose_model, load_pretrained, make_batches
    from infinity.cli.preflight import check_host_budget, check_save_dir, prepare_nvme_folders

    choice = choose_model(args)
    config = build_config(args, choice.hidden_size, choice.block_classes)
    if getattr(args, "may_restart", False) and _returns_memory_to_os(config):
        reexec_with_huge_pages()  # see infinity.engine.host_memory: only where it pays
    check_save_dir(args.save_dir, resuming=bool(args.resume or args.resume_tag))
    check_hf_output(args, choice)
    prepare_nvme_folders(config, from_flag=args.nvme_path is not None)
    if choice.hf is None:  # a preset: its size is known before anything is built
        check_host_budget(config, args.model, choice.seq, int(os.environ.get("WORLD_SIZE", "1")))
    heartbeat = _join_and_watch_peers(config)
    try:
        engine, _, _, _ = infinity.initialize(model=choice.model, config=config)
        engine.step_log.enabled = False  # the progress line (`Progress`) says more, every steps_per_print steps
        load_pretrained(choice, engine)
    except BaseException:
        if heartbeat is not None:
            heartbeat.stop()  # this rank ends now: not silent, gone
        raise
    return engine, choice, make_batches(args, choice, engine), heartbeat


def _returns_memory_to_os(config: InfinityConfig) -> bool:
    """Whether the engine will have malloc return freed memory to the OS at once (`MallocTuning`): every
    buffer a fresh mapping, where huge pages make the first touch 4x faster. False where unsure."""
    from infinity.config import resolve_batch_sizes
    from infinity.shards import MallocTuning, resolve_placement

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    try:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        placement = resolve_placement(resolve_batch_sizes(config, world), device, world, False)
    except Exception:  # the engine reports a bad config itself, in its own words
        return False
    return placement.malloc is MallocTuning.RETURN_TO_OS


def _describe(engine, name: str, seq: int) -> str:
    cfg, z = engine.config, engine.config.zero_optimization
    where = f"params on {z.offload_param.device}, optimizer on {z.offload_optimizer.device}"
    nvme = [s.nvme_path for s in (z.offload_param, z.offload_optimizer) if s.device == "nvme"]
    if nvme:
        where += f" (NVMe folder {Path(nvme[0]).resolve()})"
    return (
        f"infinity: {name} {sum(f.numel for f in engine.flats) / 1e6:.2f}M parameters, "
        f"{engine.comm.world_size} rank(s), seq {seq}, batch {cfg.train_batch_size}, {cfg.compute_dtype_name}; {where}"
    )


def run_train(args: argparse.Namespace) -> int:
    """Train per `args`; returns the process exit code. User errors raise (see `infinity.cli.faults`)."""
    if args.steps < 1 or args.save_every < 0:
        raise ConfigError("--steps must be >= 1 and --save-every >= 0")
    if args.resume_tag is not None and not args.resume_tag.strip():
        raise ConfigError("--resume-tag needs the tag of a checkpoint in --save-dir (e.g. global_step100), got ''")
    if args.resume_fallback and not (args.resume or args.resume_tag):
        raise ConfigError("--resume-fallback applies to a resume: add --resume (or --resume-tag TAG)")
    from infinity.cli.preflight import SAVE_DIR_HOLDER
    from infinity.engine.save_dir_lock import release_save_dirs

    torch.set_flush_denormal(True)
    try:
        engine, choice, data, heartbeat = _start(args)
    except BaseException:
        release_save_dirs(SAVE_DIR_HOLDER)  # an in-process caller (a notebook) holds no folder after the run
        raise
    try:
        return _train(engine, choice, data, args)
    finally:
        engine.close()  # the swap files are removed; a later run in this process may use the same folder
        release_save_dirs(SAVE_DIR_HOLDER)
        if heartbeat is not None:
            heartbeat.stop()


def _stop_if_diverged(engine, loss: float, step: int) -> None:
    """ConfigError before the step's weights are saved when its loss, or the gradient norm it stepped with (taken
    where clipping is on, as in the default job), is nan or inf; not in fp16, which skips overflowing steps. The
    loss and the norm are the same on every rank, so every rank stops."""
    norm = engine.get_global_grad_norm()
    what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {norm}"
    if (math.isfinite(loss) and (norm is None or math.isfinite(norm))) or engine.compute_dtype is torch.float16:
        return
    raise ConfigError(
        f"{what} at step {step}: training diverged, and its weights are not saved (the checkpoints in --save-dir, "
        "if any, are kept): start again with a lower --lr (a resume keeps the checkpoint's schedule)"
    )


def _loop(engine, choice, data, args: argparse.Namespace, start_step: int, progress, losses: list[float], save, say):
    """Train steps start_step+1 .. args.steps, appending each step's loss (mean over ranks) to `losses`."""
    for step in range(start_step + 1, args.steps + 1):
        step_loss = 0.0
        for _ in range(engine.gradient_accumulation_steps):
            loss = choice.loss(engine, next(data))
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / engine.gradient_accumulation_steps
        losses.append(_mean_over_ranks(engine, step_loss))
        if progress is not None:
            progress.update(step, losses[-1], engine.bytes_moved, engine.get_lr()[0])
        _stop_if_diverged(engine, losses[-1], step)
        if args.save_every and step % args.save_every == 0 and step != args.steps:
            folder = save()
            if progress is not None:
                progress.close()
            say(f"checkpoint: {folder}")


def _train(engine, choice, data, args: argparse.Namespace) -> int:
    from infinity.cli.jobs import save_hf
    from infinity.cli.progress import Progress
    from infinity.cli.resume import resume_run

    rank = engine.comm.rank
    say = print if rank == 0 else (lambda *a, **k: None)
    resumed = resume_run(engine, data, args, say) if args.resume or args.resume_tag else None
    start_step = engine.global_steps
    if resumed is not None:
        say(f"resumed from {args.save_dir} ({resumed}) at step {start_step}")
    say(_describe(engine, choice.name, choice.seq))
    if start_step >= args.steps:
        say(f"nothing to do: the checkpoint is at step {start_step} and --steps is {args.steps}")
        return 0

    def save() -> str:
        client_state = {"data": data.state_dict(), "model": args.model, "seq": choice.seq}
        return engine.save_checkpoint(args.save_dir, client_state=client_state)

    tokens_per_step = engine.config.train_batch_size * choice.seq
    progress = None
    if rank == 0:
        progress = Progress(
            args.steps, tokens_per_step, print_every=engine.config.steps_per_print, first_step=start_step
        )
    losses: list[float] = []
    started = time.perf_counter()
    try:
        _loop(engine, choice, data, args, start_step, progress, losses, save, say)
    finally:
        if progress is not None:
            progress.close()  # an error's line starts on a line of its own
    elapsed = time.perf_counter() - started
    folder = save()
    k = max(1, min(10, len(losses) // 10))
    say(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (mean of first {k} steps {sum(losses[:k]) / k:.4f}, "
        f"last {k} {sum(losses[-k:]) / k:.4f}); steps {start_step + 1}-{args.steps} in {elapsed:.1f} s, "
        f"{len(losses) * tokens_per_step / elapsed:,.0f} tokens/s, waited {engine.stall_s:.2f} s for weights"
    )
    say(f"checkpoint written to {folder}")
    hf_folder = save_hf(args, choice, engine)
    if hf_folder is not None:
        say(f"Hugging Face folder written to {hf_folder}")
    say(f"full weights: infinity consolidate {args.save_dir} model.pt   resume: add --resume")
    if getattr(args, "profile", False):
        say(f"swap traces in {profile_path(args)}: infinity profile {profile_path(args)}")
    return 0
