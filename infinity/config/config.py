"""The one typed config: DeepSpeed's JSON schema in, a frozen `InfinityConfig` out."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infinity.config.deepspeed_only import split_deepspeed_only
from infinity.config.params import filled, optimizer_params, scheduler_params
from infinity.config.schema import AUTO, ConfigError, option, parse_section, to_dict
from infinity.config.sections import (
    AioConfig,
    BF16Config,
    CheckpointConfig,
    FP16Config,
    OptimizerConfig,
    ProfilerConfig,
    SchedulerConfig,
    ZeroConfig,
)

MAX_BATCH = 2**20  # sequences: far above any real batch, far below what overflows torch's sizes

_NULL_OPTIMIZER = (
    "infinity needs an optimizer; remove the key to train with the default (AdamW: lr 1e-3, betas "
    '[0.9, 0.999], eps 1e-8, weight_decay 0), or name one: {"type": "AdamW", "params": {"lr": ...}}'
)


@dataclass(frozen=True)
class InfinityConfig:
    """A whole run's configuration; batch sizes are resolved by `resolve_batch_sizes`."""

    train_batch_size: int | None = option(None, min_value=1, max_value=MAX_BATCH, allow_auto=True)
    train_micro_batch_size_per_gpu: int | None = option(None, min_value=1, max_value=MAX_BATCH, allow_auto=True)
    gradient_accumulation_steps: int | None = option(None, min_value=1, max_value=MAX_BATCH, allow_auto=True)
    optimizer: OptimizerConfig | None = option(
        None, null_error=_NULL_OPTIMIZER, doc="absent: AdamW with DeepSpeed's Adam defaults (lr 1e-3, no weight decay)"
    )
    scheduler: SchedulerConfig | None = option(None)
    fp16: FP16Config = option(default_factory=FP16Config)
    bf16: BF16Config = option(default_factory=BF16Config, aliases=("bfloat16",))
    gradient_clipping: float = option(0.0, min_value=0.0, allow_auto=True)
    zero_optimization: ZeroConfig = option(default_factory=ZeroConfig)
    aio: AioConfig = option(default_factory=AioConfig)
    profiler: ProfilerConfig = option(default_factory=ProfilerConfig)
    checkpoint: CheckpointConfig = option(default_factory=CheckpointConfig)
    steps_per_print: int = option(
        10, min_value=1, doc="rank 0 prints the step, its learning rates and gradient norm every this many steps"
    )
    wall_clock_breakdown: bool = option(False, doc="print each step's forward, backward and step time (rank 0)")
    prescale_gradients: bool = option(False, doc="divide gradients by the world size before summing them over ranks")
    gradient_predivide_factor: float = option(
        1.0, min_value=0.0, doc="without prescale_gradients: divide by this before the sum, the rest after"
    )
    zero_allow_untested_optimizer: bool = option(False)
    seed: int | None = option(None, doc="seeds random, numpy and torch on every rank at initialize; unset: untouched")
    communication_data_type: str | None = option(
        None,
        choices=(None, "fp32", "fp16", "bf16"),
        doc="dtype gradients are reduced in across ranks (then summed in fp32); null: the compute dtype",
    )
    deepspeed_only: tuple[tuple[str, Any], ...] = option(
        (),
        from_json=False,
        doc="(dotted key, value) of each DeepSpeed-only key that asks for something without effect here, for its "
        "notice (`deepspeed_only.DEEPSPEED_ONLY`); set by load_config",
    )

    def __post_init__(self) -> None:
        if self.fp16.enabled is True and self.bf16.enabled is True:
            raise ConfigError("'fp16.enabled' and 'bf16.enabled' are both true; enable at most one")
        if self.gradient_predivide_factor <= 0:
            raise ConfigError(f"'gradient_predivide_factor' is {self.gradient_predivide_factor}; it must be > 0")

    @property
    def compute_dtype_name(self) -> str:
        for key, value in (("bf16.enabled", self.bf16.enabled), ("fp16.enabled", self.fp16.enabled)):
            if value == AUTO:
                raise ConfigError(f"'{key}' is still \"auto\"; resolve it first (resolve_auto) or set true/false")
        return "bfloat16" if self.bf16.enabled else "float16" if self.fp16.enabled else "float32"

    def to_dict(self) -> dict[str, Any]:
        """The config as JSON-able data, every default filled in (optimizer and scheduler params too)."""
        out = to_dict(self)
        if self.optimizer is not None:
            out["optimizer"]["params"] = filled(optimizer_params(self.optimizer.type, self.optimizer.params))
        if self.scheduler is not None:
            out["scheduler"]["params"] = filled(scheduler_params(self.scheduler.type, self.scheduler.params))
        return out


def _read(source: dict[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, dict):
        return source
    path = Path(source)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.json"))
        inside = f" (it holds {', '.join(found[:5])}{', ...' if len(found) > 5 else ''})" if found else ""
        raise ConfigError(f"config file '{path}' is a directory{inside}; give the path of the JSON file")
    if not path.exists():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{path}' is not text (UTF-8 JSON): {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc.strerror or exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a JSON object at the top level")
    return data


def load_config(source: dict[str, Any] | str | os.PathLike | InfinityConfig | None) -> InfinityConfig:
    """Parse and validate a DeepSpeed-style config given as a dict, a JSON file path or None; DeepSpeed's keys
    for machinery infinity lacks are judged by `deepspeed_only.DEEPSPEED_ONLY`."""
    if isinstance(source, InfinityConfig):
        return source
    data, noticed = split_deepspeed_only(InfinityConfig, _read(source))
    cfg = parse_section(InfinityConfig, data)
    return dataclasses.replace(cfg, deepspeed_only=noticed) if noticed else cfg


def resolve_batch_sizes(cfg: InfinityConfig, world_size: int) -> InfinityConfig:
    """Fill the batch triple so that train = micro x accumulation x world_size, or explain why not."""
    train, micro, gas = (
        None if v == AUTO else v
        for v in (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps)
    )
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world_size:
            raise ConfigError(
                f"train_batch_size ({train}) != train_micro_batch_size_per_gpu ({micro}) x "
                f"gradient_accumulation_steps ({gas}) x world size ({world_size}) = {micro * gas * world_size}"
            )
    elif train is not None and micro is not None:
        if train % (micro * world_size):
            raise ConfigError(
                f"train_batch_size ({train}) is not divisible by train_micro_batch_size_per_gpu ({micro}) "
                f"x world size ({world_size}) = {micro * world_size}"
            )
        gas = train // (micro * world_size)
    elif train is not None and gas is not None:
        if train % (gas * world_size):
            raise ConfigError(
                f"train_batch_size ({train}) is not divisible by gradient_accumulation_steps ({gas}) "
                f"x world size ({world_size}) = {gas * world_size}"
            )
        micro = train // (gas * world_size)
    elif train is not None:
        if train % world_size:
            raise ConfigError(f"train_batch_size ({train}) is not divisible by the world size ({world_size})")
        gas, micro = 1, train // world_size
    else:
        # "auto" means "derive it"; with too few sizes given there is nothing to derive it from, and a guess
        # of 1 would silently change the run (HF's Trainer fills these from its arguments; here nothing does)
        pairs = (("train_micro_batch_size_per_gpu", cfg.train_micro_batch_size_per_gpu),
                 ("gradient_accumulation_steps", cfg.gradient_accumulation_steps))  # fmt: skip
        auto = [repr(key) for key, value in pairs if value == AUTO]
        if auto:
            raise ConfigError(
                f"{' and '.join(auto)} {'is' if len(auto) == 1 else 'are'} \"auto\" and the other batch sizes do not "
                "determine it: set it to a number, or give 'train_batch_size' with one of the other two (Hugging "
                "Face's Trainer fills \"auto\" from its arguments; nothing does here)"
            )
        micro = micro or 1
        gas = gas or 1
    train = micro * gas * world_size
    return dataclasses.replace(
        cfg, train_batch_size=train, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=gas
    )
