"""ShardedAdam: Adam/AdamW over this rank's shards, one flat fp32 master per trainable FlatParam.

With the optimizer offloaded (`offload_optimizer.device` cpu) masters, moments and gradients live
in host memory and each shard is stepped by the native CPU Adam in one pass, which also writes the
new compute-dtype weights into the parameter shard (the fused copy-out). Otherwise they live on the
compute device and torch's fused AdamW steps them. It is a `torch.optim.Optimizer` over the master
shards, so LR schedulers drive it through `param_groups` as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from infinity.partition.flat_param import FlatParam


@dataclass
class ShardState:
    """One trainable FlatParam's optimizer state on this rank."""

    master: torch.Tensor  # fp32 weights; may alias the parameter shard in fp32 runs
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor  # fp32 gradient accumulator for this shard
    param_shard: torch.Tensor  # compute-dtype shard where the parameters live
    step: int = 0
    has_grad: bool = False


class ShardedAdam(torch.optim.Optimizer):
    """Steps the shards of `flats`; `groups` gives each param group's lr, betas, eps and weight_decay."""

    def __init__(
        self,
        shards: list[tuple[FlatParam, torch.Tensor, torch.Tensor]],
        groups: list[dict[str, Any]],
        adamw_mode: bool,
        offloaded: bool,
    ) -> None:
        """`shards` holds (flat, fp32 master shard, compute-dtype parameter shard) for each trainable flat."""
        self.adamw_mode = adamw_mode
        self.offloaded = offloaded
        self.shard_states: dict[FlatParam, ShardState] = {}
        grouped: list[list[torch.Tensor]] = [[] for _ in groups]
        for flat, master, param_shard in shards:
            state = ShardState(
                master=master,
                exp_avg=torch.zeros_like(master),
                exp_avg_sq=torch.zeros_like(master),
                grad=torch.zeros_like(master),
                param_shard=param_shard,
            )
            self.shard_states[flat] = state
            grouped[flat.group_index].append(master)
        param_groups = [{**hyper, "params": ps} for hyper, ps in zip(groups, grouped, strict=True) if ps]
        self._flat_groups = [i for i, ps in enumerate(grouped) if ps]
        super().__init__(param_groups, defaults={})
        self._torch_opt: torch.optim.Optimizer | None = None
        self.grad_bytes_to_host = 0

    # -- gradients -----------------------------------------------------------------------------

    def accumulate_grad(self, flat: FlatParam, shard_grad: torch.Tensor) -> None:
        """Add one micro-batch's reduced gradient shard (fp32, any device) into the accumulator."""
        state = self.shard_states[flat]
        if self.offloaded:
            self.grad_bytes_to_host += shard_grad.numel() * shard_grad.element_size()
        if state.has_grad:
            state.grad.add_(shard_grad.to(state.grad.device, non_blocking=True))
        else:
            state.grad.copy_(shard_grad, non_blocking=True)
            state.has_grad = True

    def local_grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards (fp64 scalar on CPU); inf/nan if they overflowed."""
        total = torch.zeros((), dtype=torch.float64)
        for state in self.shard_states.values():
            if state.has_grad:
                total += torch.linalg.vector_norm(state.grad, dtype=torch.float64).cpu() ** 2
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        for state in self.shard_states.values():
            state.has_grad = False

    # -- the step ------------------------------------------------------------------------------

    def _group_of(self, flat: FlatParam) -> dict[str, Any]:
        return self.param_groups[self._flat_groups.index(flat.group_index)]

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0) -> None:
        """One Adam step on every shard with a gradient, gradients multiplied by `grad_scale` first."""
        if closure is not None:
            raise ValueError("ShardedAdam.step does not take a closure")
        if self.offloaded:
            self._step_native(grad_scale)
        else:
            self._step_torch(grad_scale)

    def _step_native(self, grad_scale: float) -> None:
        from infinity.optim.cpu_adam import adam_step_flat

        for flat, s in self.shard_states.items():
            if not s.has_grad:
                continue
            group = self._group_of(flat)
            s.step += 1
            fused_copy = s.param_shard.dtype in (torch.bfloat16, torch.float16) and s.param_shard.device.type == "cpu"
            adam_step_flat(
                s.master,
                s.grad,
                s.exp_avg,
                s.exp_avg_sq,
                step=s.step,
                lr=group["lr"],
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adamw_mode=self.adamw_mode,
                out_copy=s.param_shard if fused_copy else None,
                grad_scale=grad_scale,
            )
            if not fused_copy and s.param_shard.data_ptr() != s.master.data_ptr():
                s.param_shard.copy_(s.master, non_blocking=True)

    def _step_torch(self, grad_scale: float) -> None:
        for group in self.param_groups:
            for master in group["params"]:
                master.grad = None
        active = []
        for flat, s in self.shard_states.items():
            if s.has_grad:
                if grad_scale != 1.0:
                    s.grad.mul_(grad_scale)
                s.master.grad = s.grad
                active.append((flat, s))
        if self._torch_opt is None:
            cls = torch.optim.AdamW if self.adamw_mode else torch.optim.Adam
            self._torch_opt = cls([dict(g) for g in self.param_groups], fused=True)
            for s in self.shard_states.values():  # torch steps our moment buffers in place
                step = torch.full((), float(s.step), dtype=torch.float32, device=s.master.device)
                self._torch_opt.state[s.master] = {"step": step, "exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq}
        for mine, theirs in zip(self.param_groups, self._torch_opt.param_groups, strict=True):
            for key in ("lr", "betas", "eps", "weight_decay"):
                theirs[key] = mine[key]
        self._torch_opt.step()
        for _, s in active:
            s.step += 1
            s.master.grad = None
            if s.param_shard.data_ptr() != s.master.data_ptr():
                s.param_shard.copy_(s.master)

    def sync_step_counts(self) -> None:
        """After restoring `ShardState.step`, make torch's per-tensor step counts agree with it."""
        if self._torch_opt is not None:
            for s in self.shard_states.values():
                self._torch_opt.state[s.master]["step"].fill_(s.step)

    @staticmethod
    def clip_coefficient(norm: float, max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
        if max_norm <= 0 or not math.isfinite(norm):
            return 1.0
        return min(1.0, max_norm / (norm + 1e-6))
