"""The native Adam's specification in plain PyTorch: torch's single-tensor Adam/AdamW formula op for op,
and the same step on moments kept in a storage format (decode, step in float32, encode).

The native kernel must equal these bit for bit on every SIMD path. They differ from torch.optim.Adam
only in sqrt: torch's CPU sqrt (MKL VML) is off by one ulp for some inputs, numpy's is IEEE.
"""

from __future__ import annotations

import numpy as np
import torch

from infinity.shards.moments import MOMENT_NAMES, SCALE_NAMES, MomentFormat, decode, encode, moment_format


def adam_formula_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    grad_scale: float = 1.0,
) -> None:
    """torch's _single_tensor_adam (foreach=False, fused=False) on float32 p, m, v in place, IEEE sqrt."""
    g = g.float() * grad_scale
    if weight_decay != 0:
        if adamw_mode:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (torch.from_numpy(np.sqrt(v.numpy())) / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / bias_correction1))


def stored_moments_step(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    fmt: str | MomentFormat,
    *,
    out_copy: torch.Tensor | None = None,
    **hyper: float,
) -> None:
    """One step with the moments in `state` (keys as moments.zero_state) stored in `fmt`, all in place.

    Decodes both moments, runs `adam_formula_step` (`hyper`: its keyword arguments), encodes the new
    moments back into `state` (bf16, 8bit: rounded stochastically, keyed by hyper["step"]), and casts the new
    p into `out_copy` if given.
    """
    fmt = moment_format(fmt)
    m, v = (decode(state[name], state.get(SCALE_NAMES[name]), fmt, name) for name in MOMENT_NAMES)
    adam_formula_step(p, g, m, v, **hyper)
    for name, value in zip(MOMENT_NAMES, (m, v), strict=True):
        codes, scale = encode(value, fmt, name, step=hyper["step"])
        state[name].copy_(codes)
        if scale is not None:
            state[SCALE_NAMES[name]].copy_(scale)
    if out_copy is not None:
        out_copy.copy_(p)
