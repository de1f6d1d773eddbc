"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) with its parameters.

Each schedule sets `lr` in every param group of the optimizer it drives; `step()` advances one
optimizer step. As in DeepSpeed, construction applies iteration -1 (WarmupLR's minimum, WarmupCosineLR's
zero), so after k optimizer steps the schedule is at iteration k - 1, and warm-up lasts at least 2 steps.
"""

from __future__ import annotations

import math
from typing import Any

from infinity.config import ConfigError


def _warmup_gamma(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    if iteration >= warmup_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps) if warmup_steps > 1 else 1.0
    return iteration / warmup_steps


class _Schedule:
    _params: dict[str, Any] = {}

    def __init__(self, optimizer, params: dict[str, Any], name: str) -> None:
        unknown = set(params) - set(self._params) - {"last_batch_iteration"}
        if unknown:
            raise ConfigError(
                f"'scheduler.params' for {name} has unknown key(s) {sorted(unknown)}; known: {sorted(self._params)}"
            )
        merged = {**self._params, **params}
        if merged.get("warmup_type", "log") not in ("log", "linear"):
            raise ConfigError(f"'scheduler.params.warmup_type' is {merged['warmup_type']!r}; use 'log' or 'linear'")
        if int(merged.get("warmup_num_steps", 1)) < 0:
            raise ConfigError("'scheduler.params.warmup_num_steps' must be >= 0")
        self.optimizer = optimizer
        self.p = merged
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.step(int(params.get("last_batch_iteration", -1)))

    def lr_at(self, iteration: int, base_lr: float) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_batch_iteration, b) for b in self.base_lrs]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    @property
    def warmup_steps(self) -> int:
        return max(2, int(self.p["warmup_num_steps"]))

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (
            self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        )
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base_lrs = list(state["base_lrs"])
        self.step(state["last_batch_iteration"])


class WarmupLR(_Schedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then constant."""

    _params = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"}

    def lr_at(self, iteration: int, base_lr: float) -> float:
        p = self.p
        if iteration < 0:
            return p["warmup_min_lr"]
        gamma = _warmup_gamma(iteration, self.warmup_steps, p["warmup_type"])
        return p["warmup_min_lr"] + (p["warmup_max_lr"] - p["warmup_min_lr"]) * gamma


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to zero at total_num_steps."""

    _params = {**WarmupLR._params, "total_num_steps": None}

    def __init__(self, optimizer, params: dict[str, Any], name: str) -> None:
        if params.get("total_num_steps") is None:
            raise ConfigError("'scheduler.params.total_num_steps' is required for WarmupDecayLR")
        super().__init__(optimizer, params, name)

    def lr_at(self, iteration: int, base_lr: float) -> float:
        p = self.p
        warmup, total = self.warmup_steps, int(p["total_num_steps"])
        if iteration < warmup:
            return super().lr_at(iteration, base_lr)
        gamma = max(0.0, (total - iteration) / max(1.0, total - warmup))
        return p["warmup_min_lr"] + (p["warmup_max_lr"] - p["warmup_min_lr"]) * gamma


class WarmupCosineLR(_Schedule):
    """A ratio of the optimizer's lr: warmup from warmup_min_ratio to 1, then cosine to cos_min_ratio."""

    _params = {
        "total_num_steps": None,
        "warmup_min_ratio": 0.0,
        "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001,
        "warmup_type": "log",
    }

    def __init__(self, optimizer, params: dict[str, Any], name: str) -> None:
        if params.get("total_num_steps") is None:
            raise ConfigError("'scheduler.params.total_num_steps' is required for WarmupCosineLR")
        super().__init__(optimizer, params, name)

    def lr_at(self, iteration: int, base_lr: float) -> float:
        p = self.p
        warmup, total = self.warmup_steps, int(p["total_num_steps"])
        if iteration < 0:
            return 0.0
        if iteration < warmup:
            gamma = _warmup_gamma(iteration, warmup, p["warmup_type"])
            ratio = p["warmup_min_ratio"] + (1.0 - p["warmup_min_ratio"]) * gamma
        else:
            progress = min(1.0, (iteration - warmup + 1) / max(1, total - warmup))
            ratio = p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return base_lr * ratio


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


def build_schedule(name: str, optimizer, params: dict[str, Any]) -> _Schedule:
    return SCHEDULES[name](optimizer, params, name)
