"""Mixed precision in plain PyTorch: the yardstick for infinity's bf16 and fp16 runs.

A compute copy of the model in bf16 or fp16 runs forward and backward; fp32 master weights take the
gradients (summed in fp32 over the micro-batches), the global norm, clipping and `torch.optim.AdamW`.
fp16 adds DeepSpeed's dynamic loss scaling, written out here from its rules (not infinity's scaler): the
loss is multiplied by the scale before backward; a step whose gradients hold an inf or nan is skipped,
and the scale halves once `hysteresis` such steps came in a row (never below `min_scale`); after
`window` clean steps it doubles and the hysteresis is restored. The clipping norm is that of the
unscaled gradients, and the gradients are unscaled (and clipped) before AdamW sees them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class DynamicScale:
    """DeepSpeed's dynamic loss scale; `update(overflow)` returns True when the step is to be skipped."""

    scale: float
    window: int
    hysteresis: int
    min_scale: float = 1.0
    _left: int = field(init=False)
    _clean: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._left = self.hysteresis

    def update(self, overflow: bool) -> bool:
        if overflow:
            if self._left > 1:
                self._left -= 1
            else:
                self.scale = max(self.scale / 2, self.min_scale)
            self._clean = 0
            return True
        self._clean += 1
        if self._clean % self.window == 0:
            self.scale *= 2
            self._left = self.hysteresis
        return False


@dataclass
class MixedRun:
    losses: list[float]  # per step, the mean of its micro-batches' unscaled losses
    scales: list[float]  # the loss scale each step ran with (1 without fp16)
    grad_norms: list[float]  # the unscaled global gradient norm of each step (inf on overflow)
    skipped: list[bool]
    state: dict[str, torch.Tensor]  # the fp32 masters at the end
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # AdamW's (m, v) by name


def train_mixed_reference(
    model_fn: Callable[[], nn.Module],
    batches: Iterable,
    steps: int,
    *,
    dtype: torch.dtype,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    clip: float,
    grad_accum: int = 1,
    loss_scale: DynamicScale | None = None,
) -> MixedRun:
    master = model_fn().float()
    compute = model_fn().to(dtype)
    compute.load_state_dict(master.state_dict())
    params = list(master.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    it = iter(batches)
    run = MixedRun([], [], [], [], {})
    for _ in range(steps):
        scale = loss_scale.scale if loss_scale is not None else 1.0
        grads: list[torch.Tensor | None] = [None] * len(params)
        step_loss = 0.0
        for _ in range(grad_accum):
            x, y = (t.to(dtype) if t.is_floating_point() else t for t in next(it))
            _, loss = compute(x, y)
            (loss * (scale / grad_accum)).backward()
            step_loss += loss.item() / grad_accum
            for i, q in enumerate(compute.parameters()):
                if q.grad is not None:
                    grads[i] = q.grad.float() if grads[i] is None else grads[i] + q.grad.float()
            compute.zero_grad(set_to_none=True)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads if g is not None]))
        norm = norm.item() / scale if math.isfinite(norm.item()) else math.inf
        run.losses.append(step_loss)
        run.scales.append(scale)
        run.grad_norms.append(norm)
        skip = loss_scale.update(not math.isfinite(norm)) if loss_scale is not None else False
        run.skipped.append(skip)
        if skip:
            continue
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g * (coef / scale)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, q in zip(params, compute.parameters(), strict=True):
                q.copy_(p)
    run.state = {k: v.detach().clone() for k, v in master.state_dict().items()}
    for name, p in master.named_parameters():
        if p in opt.state:
            run.moments[name] = (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
    return run
