"""What `infinity train` trains and on what: a GPT preset or a Hugging Face folder; the bundled corpus or a file.

`choose_model(args)` builds the model (a preset in memory, a Hugging Face folder without its weights);
`make_batches(args, choice, engine)` the batch stream; `choice.loss(engine, batch)` one micro-batch's loss.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infinity.config import ConfigError
from infinity.models.gpt import GPT_PRESETS

DEFAULT_SEQ = 64


@dataclass
class ModelChoice:
    """The model to train and what the rest of the job needs to know of it."""

    model: nn.Module
    name: str  # for the description line
    seq: int
    hidden_size: int | None
    hf: Any = None  # an `infinity.models.hf.HFFolder` for a Hugging Face folder

    @property
    def block_classes(self) -> tuple[str, ...] | None:
        """The classes that form blocks when the config names none (None: the config decides)."""
        return self.hf.block_classes if self.hf is not None else None

    def loss(self, engine, batch) -> torch.Tensor:
        """One micro-batch's mean loss: next-token cross-entropy."""
        if self.hf is not None:  # transformers shifts the labels itself
            batch = batch.to(engine.device)
            return engine(input_ids=batch, labels=batch).loss
        x, y = batch if isinstance(batch, tuple) else (batch[:, :-1], batch[:, 1:])
        return engine(x.to(engine.device), y.to(engine.device))[1]


def _preset(args: argparse.Namespace) -> ModelChoice:
    from infinity.estimator import available_host_bytes, format_bytes
    from infinity.models.gpt import GPT, count_params, gpt_preset

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
    torch.manual_seed(args.seed)
    return ModelChoice(GPT(model_cfg), f"GPT '{args.model}'", seq, model_cfg.n_embd)


def _hf_folder(args: argparse.Namespace) -> ModelChoice:
    from infinity.models.hf import load_hf_folder

    if not args.data:
        raise ConfigError(f"--model {args.model} (a Hugging Face folder) needs --data FILE: plain text or JSON lines")
    hf = load_hf_folder(args.model)
    if hf.tokenizer is None:
        raise ConfigError(f"'{args.model}' has no tokenizer files (tokenizer.json, tokenizer_config.json ...)")
    seq = args.seq or min(DEFAULT_SEQ, hf.max_positions or DEFAULT_SEQ)
    if hf.max_positions is not None and seq > hf.max_positions:
        raise ConfigError(f"--seq {seq} exceeds the model's {hf.max_positions} positions")
    name = f"{type(hf.model).__name__} from {hf.folder}"
    return ModelChoice(hf.model, name, seq, hf.hidden_size, hf)


def choose_model(args: argparse.Namespace) -> ModelChoice:
    """`--model`: a preset name, or a folder with a config.json."""
    if args.model in GPT_PRESETS:
        if getattr(args, "save_hf", None):
            raise ConfigError("--save-hf writes a Hugging Face folder: it needs --model FOLDER (a Hugging Face model)")
        return _preset(args)
    if Path(args.model, "config.json").is_file():
        return _hf_folder(args)
    from infinity.cli.estimate import unknown_model

    raise unknown_model(args.model)


def load_pretrained(choice: ModelChoice, engine) -> None:
    """Stream a Hugging Face folder's weights into the engine's shards (nothing to do for a preset)."""
    if choice.hf is None:
        return
    from infinity.engine.checkpoint import CheckpointError
    from infinity.models.hf_weights import checkpoint_tensors

    try:
        engine.load_full_state(checkpoint_tensors(choice.hf.folder, choice.hf.model))
    except (ValueError, KeyError) as exc:  # a damaged, missing or mismatched weight file, named in the message
        raise CheckpointError(f"the weights in '{choice.hf.folder}' cannot be loaded: {exc}") from exc
    except FileNotFoundError as exc:
        if exc.errno is not None:  # the system's: a path error, classified as such
            raise
        raise CheckpointError(f"the weights in '{choice.hf.folder}' cannot be loaded: {exc}") from exc


def make_batches(args: argparse.Namespace, choice: ModelChoice, engine) -> Iterator:
    """The job's micro-batches on this rank: the bundled corpus's random windows, or `--data` packed."""
    from infinity.data.corpus import ByteBatches, load_corpus
    from infinity.data.text import ByteTokenizer, HFTokenizer, PackedBatches, load_tokens

    micro_bs, comm = engine.config.train_micro_batch_size_per_gpu, engine.comm
    if not args.data:
        return ByteBatches(load_corpus("train"), micro_bs, choice.seq, args.seed, comm.rank, comm.world_size)
    tokenizer = HFTokenizer(choice.hf.tokenizer) if choice.hf is not None else ByteTokenizer()
    say = print if comm.rank == 0 else (lambda *_: None)
    if comm.rank == 0:  # one rank tokenizes and writes the cache; the others read it
        tokens = load_tokens(args.data, tokenizer, say)
    comm.barrier("data tokenized")
    if comm.rank != 0:
        tokens = load_tokens(args.data, tokenizer, say)
    # A preset computes its own next-token targets: each of its sequences is one token longer.
    seq = choice.seq if choice.hf is not None else choice.seq + 1
    return PackedBatches(tokens, micro_bs, seq, args.seed, comm.rank, comm.world_size)


def check_hf_output(args: argparse.Namespace, choice: ModelChoice) -> None:
    """Refuse a --save-hf folder the save would wrongly replace (see `models.hf.check_hf_output`), before training."""
    if not getattr(args, "save_hf", None) or choice.hf is None:
        return
    from infinity.models.hf import check_hf_output as check

    check(args.save_hf, keep=(choice.hf.folder, args.save_dir), what="--save-hf")


def save_hf(args: argparse.Namespace, choice: ModelChoice, engine) -> Path | None:
    """With --save-hf: write the trained weights as a Hugging Face folder (every rank calls it)."""
    if not getattr(args, "save_hf", None) or choice.hf is None:
        return None
    from infinity.models.hf import save_hf_folder

    return save_hf_folder(engine, choice.hf, args.save_hf)
