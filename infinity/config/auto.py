"""Resolving "auto" config values the way Hugging Face's DeepSpeed integration does.

HF's Trainer fills "auto" from its TrainingArguments (batch size, accumulation, learning rate, Adam
betas/eps, weight decay, max_grad_norm, warmup and total steps, fp16/bf16) and from the model's
hidden size (reduce_bucket_size = h*h, stage3_prefetch_bucket_size = 0.9*h*h,
stage3_param_persistence_threshold = 10*h). Sizes written in bytes ("64MB") become elements of the
resolved compute dtype here too. Here `AutoValues` plays the TrainingArguments' part:
`infinity train` builds one from its arguments and defaults. An "auto" left without a value is an
error naming the key, never a silent default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from infinity.config.schema import AUTO, ConfigError
from infinity.config.sizes import resolve_byte_sizes

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


@dataclass(frozen=True)
class AutoValues:
    """What "auto" resolves to (None: this value is unknown, so an "auto" needing it is an error)."""

    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    learning_rate: float | None = None
    adam_betas: tuple[float, float] | None = None
    adam_epsilon: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None
    warmup_steps: int | None = None
    total_steps: int | None = None
    fp16: bool | None = None
    bf16: bool | None = None


def _hidden_rules(hidden: int) -> dict[str, int]:
    return {
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }


def _fill(params: dict[str, Any], rules: dict[str, Any]) -> dict[str, Any]:
    """`params` with each "auto" replaced by its rule's value when that value is known."""
    out = dict(params)
    for key, value in params.items():
        if value == AUTO and rules.get(key) is not None:
            out[key] = list(rules[key]) if isinstance(rules[key], tuple) else rules[key]
    return out


def unresolved_auto_keys(cfg: Any, include_batch: bool = False) -> list[str]:
    """Every key path of `cfg` still set to "auto" (the batch-size triple only if `include_batch`)."""
    found: list[str] = []

    def walk(obj: Any, path: str) -> None:
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), f"{path}.{f.name}" if path else f.name)
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{path}.{key}")
        elif obj == AUTO and (include_batch or path not in _BATCH_KEYS):
            found.append(path)

    walk(cfg, "")
    return found


def resolve_auto(cfg: Any, hidden_size: int | None, values: AutoValues | None = None) -> Any:
    """`cfg` (an InfinityConfig) with "auto" values filled from `values` and the model's `hidden_size`.

    The batch-size triple's "auto" entries take `values`' batch sizes when known and otherwise count as
    not given (`resolve_batch_sizes` derives them). Raises ConfigError naming every other "auto" left.
    """
    v = values or AutoValues()
    updates: dict[str, Any] = {}
    if cfg.train_micro_batch_size_per_gpu == AUTO and v.micro_batch_size is not None:
        updates["train_micro_batch_size_per_gpu"] = v.micro_batch_size
    if cfg.gradient_accumulation_steps == AUTO and v.gradient_accumulation_steps is not None:
        updates["gradient_accumulation_steps"] = v.gradient_accumulation_steps
    if cfg.gradient_clipping == AUTO and v.max_grad_norm is not None:
        updates["gradient_clipping"] = float(v.max_grad_norm)
    if cfg.fp16.enabled == AUTO and v.fp16 is not None:
        updates["fp16"] = dataclasses.replace(cfg.fp16, enabled=v.fp16)
    if cfg.bf16.enabled == AUTO and v.bf16 is not None:
        updates["bf16"] = dataclasses.replace(cfg.bf16, enabled=v.bf16)
    z = cfg.zero_optimization
    if hidden_size is not None:
        z_updates = {k: rule for k, rule in _hidden_rules(hidden_size).items() if getattr(z, k) == AUTO}
        updates["zero_optimization"] = dataclasses.replace(z, **z_updates)
    if cfg.optimizer is not None:
        rules = {
            "lr": v.learning_rate,
            "betas": v.adam_betas,
            "eps": v.adam_epsilon,
            "weight_decay": v.weight_decay,
        }
        updates["optimizer"] = dataclasses.replace(cfg.optimizer, params=_fill(cfg.optimizer.params, rules))
    if cfg.scheduler is not None:
        rules = {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": v.learning_rate,
            "warmup_num_steps": v.warmup_steps,
            "total_num_steps": v.total_steps,
        }
        updates["scheduler"] = dataclasses.replace(cfg.scheduler, params=_fill(cfg.scheduler.params, rules))
    resolved = dataclasses.replace(cfg, **updates)
    left = unresolved_auto_keys(resolved)
    if left:
        hidden_keys = [k for k in left if k.rpartition(".")[2] in _hidden_rules(1)]
        why = (
            " (the model's config has no hidden_size / n_embd / d_model to derive them from)"
            if hidden_keys and hidden_size is None
            else ""
        )
        raise ConfigError(
            f'config value(s) {", ".join(repr(k) for k in left)} are "auto" and nothing here resolves them{why}; '
            'replace "auto" with a value, or train with `infinity train`, which fills "auto" from its arguments'
        )
    zero = resolve_byte_sizes(resolved.zero_optimization, resolved.compute_dtype_name, "zero_optimization")
    return dataclasses.replace(resolved, zero_optimization=zero)
