"""TorchFusedStepper: the optimizer state in device-tier memory, stepped by torch's fused AdamW in one call."""

from __future__ import annotations

from typing import Any

import torch

from infinity.optim.param_steps import Run, count_step, partial_runs, step_presence
from infinity.optim.steppers import Hyper
from infinity.partition.flat_param import FlatParam
from infinity.shards import LentShard, ShardStore


class TorchFusedStepper:
    """torch's fused AdamW over masters, moments and gradients the store keeps in device-tier memory."""

    def __init__(self, shards: ShardStore, hyper: Hyper, adamw_mode: bool) -> None:
        self.shards = shards
        self.hyper = hyper
        self.adamw_mode = adamw_mode
        self.stepped_in_backward = 0
        self._lent: dict[FlatParam, LentShard] = {}  # memory homes: lent once, stable tensors for torch
        self._torch_opt: torch.optim.Optimizer | None = None

    @property
    def in_progress(self) -> bool:
        return False

    def arrive(self, flat: FlatParam, grad: torch.Tensor) -> None:  # pragma: no cover - the placement never asks
        raise RuntimeError("the torch stepper steps after backward only")

    def defer(self, flats, grad_scale, hyper) -> None:  # pragma: no cover - the placement never asks
        raise RuntimeError("the torch stepper steps after backward only")

    def expect_defer(self) -> None:  # pragma: no cover - the placement never asks
        raise RuntimeError("the torch stepper steps after backward only")

    def _lend_all(self) -> None:
        groups: dict[int, list[torch.Tensor]] = {}
        for flat in self.shards.records:
            lent = self._lent[flat] = self.shards.lend(flat, with_grad=True)
            groups.setdefault(flat.group_index, []).append(lent.master)
        cls = torch.optim.AdamW if self.adamw_mode else torch.optim.Adam
        self._torch_opt = cls([{"params": ps, "group": i} for i, ps in sorted(groups.items())], fused=True)
        for lent in self._lent.values():  # torch steps the store's moment buffers in place
            step = torch.zeros((), dtype=torch.float32, device=lent.master.device)
            self._torch_opt.state[lent.master] = {"step": step, "exp_avg": lent.exp_avg, "exp_avg_sq": lent.exp_avg_sq}

    def step(self, flats: list[FlatParam], grad_scale: float) -> None:
        if self._torch_opt is None:
            self._lend_all()
        active = [self._lent[f] for f in flats]
        used = {lent.flat: step_presence(self.shards, lent.flat) for lent in active}
        runs = {lent.flat: partial_runs(lent.flat, self.shards.records[lent.flat], used[lent.flat]) for lent in active}
        for lent in active:
            # a flat stepped in runs (some parameters got no gradient) is left out of the one fused call
            lent.master.grad = lent.grad if runs[lent.flat] is None else None
            # the store owns step counts (checkpoints restore them); torch adds one as it steps
            self._torch_opt.state[lent.master]["step"].fill_(self.shards.records[lent.flat].step)
        for group in self._torch_opt.param_groups:
            hyper = self.hyper(group["group"])
            for key in ("lr", "betas", "eps", "weight_decay"):
                group[key] = hyper[key]
        # torch's fused kernel divides each gradient by `grad_scale` as it reads it (as AMP unscales), which
        # saves a pass over the gradients of its own
        inverse = None
        if grad_scale != 1.0 and active:
            inverse = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=active[0].master.device)
        self._torch_opt.grad_scale = inverse
        self._torch_opt.step()
        for lent in active:
            if runs[lent.flat] is not None:
                self._step_runs(lent, runs[lent.flat], self.hyper(lent.flat.group_index), inverse)
            count_step(lent.flat, self.shards.records[lent.flat], used[lent.flat])
            lent.master.grad = None
            self.shards.give_back(lent, param_written=False).finish()

    def _step_runs(self, lent: LentShard, runs: list[Run], hyper: dict[str, Any], inverse: torch.Tensor | None) -> None:
        """torch's fused AdamW over `runs` of the shard alone, each with its own step count."""
        if not runs:  # this rank's part of the flat holds only parameters that got no gradient
            return
        views = [lent.master[r.lo : r.hi] for r in runs]
        cls = torch.optim.AdamW if self.adamw_mode else torch.optim.Adam
        opt = cls(views, **{k: hyper[k] for k in ("lr", "betas", "eps", "weight_decay")}, fused=True)
        for view, r in zip(views, runs, strict=True):
            view.grad = lent.grad[r.lo : r.hi]
            step = torch.full((), float(r.step - 1), dtype=torch.float32, device=view.device)
            moments = {"exp_avg": lent.exp_avg[r.lo : r.hi], "exp_avg_sq": lent.exp_avg_sq[r.lo : r.hi]}
            opt.state[view] = {"step": step, **moments}
        opt.grad_scale = inverse
        opt.step()

    def drain(self, raise_errors: bool = True) -> None:
        pass
