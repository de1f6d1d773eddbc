"""Loss scaling for fp16: static, or dynamic with DeepSpeed's window and hysteresis rules."""

from __future__ import annotations

from typing import Any

from infinity.config import FP16Config


class LossScaler:
    """Scale for the loss; `update(overflow)` returns True when the step must be skipped.

    Dynamic (loss_scale 0): start at 2**initial_scale_power; on overflow, after `hysteresis`
    overflows in a row, halve (not below min_loss_scale); after `loss_scale_window` clean steps,
    double. Static: a fixed scale, and overflowing steps are still skipped.
    """

    def __init__(self, cfg: FP16Config | None) -> None:
        self.enabled = cfg is not None and cfg.enabled
        self.dynamic = self.enabled and cfg.loss_scale == 0
        if not self.enabled:
            self.scale = 1.0
        elif self.dynamic:
            self.scale = float(2**cfg.initial_scale_power)
        else:
            self.scale = float(cfg.loss_scale)
        self.cfg = cfg
        self.hysteresis_left = cfg.hysteresis if self.enabled else 0
        self.clean_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> bool:
        if not self.enabled:
            return False
        if overflow:
            self.skipped_steps += 1
            if self.dynamic:
                if self.hysteresis_left > 1:
                    self.hysteresis_left -= 1
                elif self.scale <= self.cfg.min_loss_scale:
                    raise FloatingPointError(
                        f"fp16 gradients overflowed at the minimum loss scale ({self.cfg.min_loss_scale}); "
                        "training cannot continue: lower the learning rate, or use bf16"
                    )
                else:
                    self.scale = max(self.scale / 2, self.cfg.min_loss_scale)
                self.clean_steps = 0
            return True
        if self.dynamic:
            if self.cfg.consecutive_hysteresis:
                self.hysteresis_left = self.cfg.hysteresis
            self.clean_steps += 1
            if self.clean_steps % self.cfg.loss_scale_window == 0:
                self.scale *= 2
                if not self.cfg.consecutive_hysteresis:
                    self.hysteresis_left = self.cfg.hysteresis
        return False

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = state["scale"]
        self.hysteresis_left = state["hysteresis_left"]
        self.clean_steps = state["clean_steps"]
        self.skipped_steps = state["skipped_steps"]
