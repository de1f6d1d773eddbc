"""Typed `optimizer.params` and `scheduler.params`, per optimizer and schedule type.

The config keeps `params` as the dict the user wrote (the engine reads it as DeepSpeed does); these
dataclasses validate it once at load time, so a misspelt or mistyped key is an error naming its full
path and the closest known key, and they supply the defaults `infinity config` prints.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from infinity.config.schema import AUTO, ConfigError, option, parse_section, to_dict


@dataclass(frozen=True)
class AdamParams:
    """`optimizer.params` for Adam / AdamW (DeepSpeed's names and defaults)."""

    lr: float = option(1e-3, min_value=0.0, allow_auto=True)
    betas: tuple[float, ...] = option((0.9, 0.999), allow_auto=True, doc="(beta1, beta2), each in [0, 1)")
    eps: float = option(1e-8, min_value=0.0, allow_auto=True)
    weight_decay: float = option(0.0, min_value=0.0, allow_auto=True)
    adam_w_mode: bool = option(True, doc="Adam with decoupled weight decay (AdamW); 'AdamW' always is")
    torch_adam: bool = option(False, doc="accepted for DeepSpeed compatibility; the step is infinity's own")
    amsgrad: bool = option(False, doc="must stay false: AMSGrad is not implemented")
    bias_correction: bool = option(True, doc="must stay true")

    def __post_init__(self) -> None:
        if self.betas != AUTO:
            if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
                raise ConfigError(
                    f"'optimizer.params.betas' is {list(self.betas)}; it must be two numbers [beta1, beta2] in [0, 1)"
                )
        if self.eps != AUTO and self.eps <= 0:
            raise ConfigError(f"'optimizer.params.eps' is {self.eps}; it must be > 0")


@dataclass(frozen=True)
class WarmupLRParams:
    """`scheduler.params` for WarmupLR: warmup_min_lr to warmup_max_lr, then constant."""

    warmup_min_lr: float = option(0.0, min_value=0.0, allow_auto=True)
    warmup_max_lr: float = option(0.001, min_value=0.0, allow_auto=True)
    warmup_num_steps: int = option(1000, min_value=0, allow_auto=True)
    warmup_type: str = option("log", choices=("log", "linear"))
    last_batch_iteration: int = option(-1, min_value=-1)


@dataclass(frozen=True, kw_only=True)
class WarmupDecayLRParams(WarmupLRParams):
    """`scheduler.params` for WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: int = option(min_value=1, allow_auto=True)


@dataclass(frozen=True)
class WarmupCosineLRParams:
    """`scheduler.params` for WarmupCosineLR: a ratio of the optimizer's lr, warmup then cosine."""

    total_num_steps: int = option(min_value=1, allow_auto=True)
    warmup_min_ratio: float = option(0.0, min_value=0.0, max_value=1.0)
    warmup_num_steps: int = option(1000, min_value=0, allow_auto=True)
    cos_min_ratio: float = option(0.0001, min_value=0.0, max_value=1.0)
    warmup_type: str = option("log", choices=("log", "linear"))
    last_batch_iteration: int = option(-1, min_value=-1)


OPTIMIZER_PARAMS: dict[str, type] = {"adam": AdamParams, "adamw": AdamParams}
SCHEDULER_PARAMS: dict[str, type] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}


def _parse(cls: type, params: dict[str, Any], path: str, type_name: str) -> Any:
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in params if k not in known]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
            if close:
                hints.append(f"did you mean '{close[0]}' for '{key}'?")
        raise ConfigError(
            f"'{path}' has unknown key(s) {unknown} for {type_name}: {' '.join(hints) or ''} "
            f"known keys: {', '.join(known)}".replace(":  ", ": ")
        )
    return parse_section(cls, params, path)


def optimizer_params(type_name: str, params: dict[str, Any]) -> Any:
    """Validate `optimizer.params` for `type_name`; returns the typed params (defaults filled)."""
    return _parse(OPTIMIZER_PARAMS[type_name.lower()], params, "optimizer.params", type_name)


def scheduler_params(type_name: str, params: dict[str, Any]) -> Any:
    """Validate `scheduler.params` for `type_name`; returns the typed params (defaults filled)."""
    return _parse(SCHEDULER_PARAMS[type_name], params, "scheduler.params", type_name)


def filled(params: Any) -> dict[str, Any]:
    """Typed params as a JSON-able dict, every default present."""
    return to_dict(params)
