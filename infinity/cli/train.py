"""`infinity train`: the default job trains the small GPT on the bundled corpus with ZeRO-3 and NVMe offload.

Every flag overrides the embedded default; `--config` replaces the default config with a DeepSpeed
JSON file whose "auto" values are filled from these arguments, as Hugging Face's Trainer fills them.
Under `torchrun` every rank trains its slice of each batch; rank 0 prints and the checkpoint is sharded.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

from infinity.config import AutoValues, ConfigError, InfinityConfig, load_config, resolve_auto
from infinity.models.gpt import GPT_PRESETS

DEFAULT_MODEL = "small"
DEFAULT_STEPS = 300
DEFAULT_SEQ = 64
DEFAULT_SAVE_DIR = "runs/default"
DEFAULT_NVME_PATH = "./nvme"
LR = 3e-3
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
        "offload_param": {"device": "nvme", "nvme_path": DEFAULT_NVME_PATH},
        "offload_optimizer": {"device": "nvme", "nvme_path": DEFAULT_NVME_PATH},
    },
    "steps_per_print": 25,
}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a DeepSpeed-style JSON config (default: the embedded one)")
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=list(GPT_PRESETS), help="GPT preset (default: small)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps in total (resume included)")
    parser.add_argument("--seq", type=int, help=f"tokens per sequence (default: {DEFAULT_SEQ}, at most the preset's)")
    parser.add_argument("--save-dir", default=DEFAULT_SAVE_DIR, help="where checkpoints are written")
    parser.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    parser.add_argument("--nvme-path", help=f"folder for NVMe offload (default: {DEFAULT_NVME_PATH})")
    parser.add_argument(
        "--offload", choices=("none", "cpu", "nvme"), help="override offload_param and offload_optimizer devices"
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="compute dtype (default: the config's)")
    parser.add_argument("--seed", type=int, default=1234)
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
        learning_rate=LR,
        adam_betas=BETAS,
        adam_epsilon=1e-8,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM,
        warmup_steps=max(1, args.steps // 10),
        total_steps=args.steps,
        fp16=args.dtype == "fp16",
        bf16=args.dtype == "bf16",
    )


def _with_offload(cfg: InfinityConfig, device: str | None, nvme_path: str | None) -> InfinityConfig:
    z = cfg.zero_optimization
    param, optim = z.offload_param, z.offload_optimizer
    if device is not None:
        param, optim = dataclasses.replace(param, device=device), dataclasses.replace(optim, device=device)
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


def build_config(args: argparse.Namespace, hidden_size: int | None) -> InfinityConfig:
    """The run's config: --config (or the default), --offload / --nvme-path / --dtype / --profile, "auto" resolved."""
    raw = args.config if args.config else copy.deepcopy(DEFAULT_CONFIG)
    cfg = load_config(raw)
    cfg = _with_profile(_with_dtype(_with_offload(cfg, args.offload, args.nvme_path), args.dtype), args)
    return resolve_auto(cfg, hidden_size, auto_values(args))


# -- the job -----------------------------------------------------------------------------------


def _model_config(args: argparse.Namespace):
    from infinity.estimator import available_host_bytes, format_bytes
    from infinity.models.gpt import count_params, gpt_preset

    preset = gpt_preset(args.model)
    seq = args.seq or min(DEFAULT_SEQ, preset.block_size)
    if seq > preset.block_size:
        raise ConfigError(f"--seq {seq} exceeds the '{args.model}' preset's block_size {preset.block_size}")
    model_cfg = gpt_preset(args.model, block_size=seq)
    build_bytes = 4 * count_params(model_cfg)
    if build_bytes > available_host_bytes():
        raise ConfigError(
            f"building GPT '{args.model}' in fp32 takes {format_bytes(build_bytes)} of host memory and "
            f"{format_bytes(available_host_bytes())} is available; see `infinity estimate --model {args.model}`"
        )
    return model_cfg


def _mean_over_ranks(engine, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=engine.comm.device)  # NCCL reduces GPU tensors only
    if engine.comm.world_size > 1:
        engine.comm.all_reduce(t, "loss for the progress display")
        t /= engine.comm.world_size
    return t.item()


def _start(args: argparse.Namespace):
    """Build the model, config, engine and batches; returns (engine, model config, batches)."""
    import infinity
    from infinity.data.corpus import ByteBatches, load_corpus
    from infinity.models.gpt import GPT

    model_cfg = _model_config(args)
    config = build_config(args, model_cfg.n_embd)
    for section in (config.zero_optimization.offload_param, config.zero_optimization.offload_optimizer):
        if section.device == "nvme":
            Path(section.nvme_path).mkdir(parents=True, exist_ok=True)  # the engine wants it to exist
    torch.manual_seed(args.seed)
    engine, _, _, _ = infinity.initialize(model=GPT(model_cfg), config=config)
    cfg = engine.config
    data = ByteBatches(
        load_corpus("train"),
        cfg.train_micro_batch_size_per_gpu,
        model_cfg.block_size,
        args.seed,
        engine.comm.rank,
        engine.comm.world_size,
    )
    return engine, model_cfg, data


def _describe(engine, args: argparse.Namespace, seq: int) -> str:
    cfg, z = engine.config, engine.config.zero_optimization
    where = f"params on {z.offload_param.device}, optimizer on {z.offload_optimizer.device}"
    nvme = [s.nvme_path for s in (z.offload_param, z.offload_optimizer) if s.device == "nvme"]
    if nvme:
        where += f" (NVMe folder {Path(nvme[0]).resolve()})"
    return (
        f"infinity: GPT '{args.model}' {sum(f.numel for f in engine.flats) / 1e6:.2f}M parameters, "
        f"{engine.comm.world_size} rank(s), seq {seq}, batch {cfg.train_batch_size}, {cfg.compute_dtype_name}; {where}"
    )


def run_train(args: argparse.Namespace) -> int:
    """Train per `args`; returns the process exit code (2 for a config or checkpoint problem)."""
    from infinity.cli.progress import Progress
    from infinity.engine.checkpoint import CheckpointError

    if args.steps < 1 or args.save_every < 0:
        print("infinity train: --steps must be >= 1 and --save-every >= 0", file=sys.stderr)
        return 2
    torch.set_flush_denormal(True)
    try:
        engine, model_cfg, data = _start(args)
    except ConfigError as exc:
        print(f"infinity train: {exc}", file=sys.stderr)
        return 2
    if args.resume:
        try:
            _, client = engine.load_checkpoint(args.save_dir)
            data.load_state_dict(client["data"])  # ValueError if the batch stream differs
        except (CheckpointError, ValueError, KeyError) as exc:
            print(f"infinity train: cannot resume from '{args.save_dir}': {exc}", file=sys.stderr)
            return 2
    rank = engine.comm.rank
    say = print if rank == 0 else (lambda *a, **k: None)
    start_step = engine.global_steps
    if args.resume:
        say(f"resumed from {args.save_dir} at step {start_step}")
    say(_describe(engine, args, model_cfg.block_size))
    if start_step >= args.steps:
        say(f"nothing to do: the checkpoint is at step {start_step} and --steps is {args.steps}")
        return 0

    def save() -> str:
        client_state = {"data": data.state_dict(), "model": args.model, "seq": model_cfg.block_size}
        return engine.save_checkpoint(args.save_dir, client_state=client_state)

    tokens_per_step = engine.config.train_batch_size * model_cfg.block_size
    progress = None
    if rank == 0:
        progress = Progress(
            args.steps, tokens_per_step, print_every=engine.config.steps_per_print, first_step=start_step
        )
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(start_step + 1, args.steps + 1):
        step_loss = 0.0
        for _ in range(engine.gradient_accumulation_steps):
            x, y = next(data)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / engine.gradient_accumulation_steps
        losses.append(_mean_over_ranks(engine, step_loss))
        if progress is not None:
            progress.update(step, losses[-1], engine.bytes_moved, engine.get_lr()[0])
        if args.save_every and step % args.save_every == 0 and step != args.steps:
            folder = save()
            if progress is not None:
                progress.close()
            say(f"checkpoint: {folder}")
    elapsed = time.perf_counter() - started
    if progress is not None:
        progress.close()
    folder = save()
    k = max(1, min(10, len(losses) // 10))
    say(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (mean of first {k} steps {sum(losses[:k]) / k:.4f}, "
        f"last {k} {sum(losses[-k:]) / k:.4f}); steps {start_step + 1}-{args.steps} in {elapsed:.1f} s, "
        f"{len(losses) * tokens_per_step / elapsed:,.0f} tokens/s, waited {engine.stall_s:.2f} s for weights"
    )
    say(f"checkpoint written to {folder}")
    say(f"full weights: infinity consolidate {args.save_dir} model.pt   resume: add --resume")
    if getattr(args, "profile", False):
        say(f"swap traces in {profile_path(args)}: infinity profile {profile_path(args)}")
    return 0
