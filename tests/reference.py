"""The yardstick: plain PyTorch on one process, no sharding, no offload, `torch.optim.AdamW`.

Every infinity configuration must reproduce `train_reference` on the same model, data and seed.

How batches map: `batches` yields *global micro-batches* `(x, y)` in order, and optimizer step s consumes
the next `grad_accum` of them. A global micro-batch is what all N ranks see in one micro-step,
concatenated in rank order (rank 0's rows first); `ByteBatches(tokens, N * b, T, seed)` (world_size=1)
yields exactly the concatenation of `ByteBatches(tokens, b, T, seed, rank=r, world_size=N)` over r.
As in DeepSpeed, each micro-batch's loss is divided by `grad_accum` before backward, gradients are
summed over the micro-batches, clipped by global norm, then one AdamW step (one parameter group, weight
decay on every parameter) is taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn as nn


def train_reference(
    model_fn: Callable[[], nn.Module],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    grad_clip: float = 0.0,
    grad_accum: int = 1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train `model_fn()` for `steps` optimizer steps; return (per-step loss, final fp32 state_dict).

    A step's loss is the mean of its micro-batches' unscaled losses. `model_fn` must build the same
    initial weights on every call (seed inside it); the model's forward is `model(x, y) -> (out, loss)`.
    With `dtype=torch.bfloat16` the forward and backward run on a bf16 copy while fp32 master weights,
    fp32-accumulated gradients, clipping and AdamW stay in fp32 (mixed precision as DeepSpeed's bf16).
    Training runs on `device` (the batches are moved there); the returned state is on the CPU.
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"train_reference supports float32 and bfloat16, not {dtype}")
    master = model_fn().float().to(device)
    compute = master if dtype == torch.float32 else model_fn().to(device, dtype)
    if compute is not master:
        compute.load_state_dict(master.state_dict())
    params = list(master.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    it = iter(batches)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for _ in range(grad_accum):
            x, y = (t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in next(it))
            _, loss = compute(x, y)
            (loss / grad_accum).backward()
            step_loss += loss.item() / grad_accum
            if compute is not master:
                for p, q in zip(params, compute.parameters(), strict=True):
                    if q.grad is not None:
                        p.grad = q.grad.float() if p.grad is None else p.grad + q.grad.float()
                compute.zero_grad(set_to_none=True)
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        if compute is not master:
            with torch.no_grad():
                for p, q in zip(params, compute.parameters(), strict=True):
                    q.copy_(p)
        losses.append(step_loss)
    return losses, {k: v.detach().to("cpu", copy=True) for k, v in master.state_dict().items()}
