"""ShardedAdam: Adam/AdamW over this rank's shards, one flat fp32 master per trainable FlatParam.

With the optimizer offloaded (`offload_optimizer.device` cpu) masters, moments and gradients live
in host memory and each shard is stepped by the native CPU Adam in one pass, which also writes the
new compute-dtype weights into the parameter shard (the fused copy-out). Otherwise they live on the
compute device and torch's fused AdamW steps them. It is a `torch.optim.Optimizer` over the master
shards, so LR schedulers drive it through `param_groups` as usual. Where the parameter shards live
on NVMe, the new weights go to a small staging buffer and are written there asynchronously.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from infinity.partition.flat_param import FlatParam

# Parameter shards written to NVMe after a step, at most this many in flight (each holds its buffer).
MAX_PARAM_WRITES_IN_FLIGHT = 4


class ParamSink(Protocol):
    """Where new compute-dtype weights go: the engine's placement of parameter shards."""

    def updated_in_place(self, flat: FlatParam) -> None: ...

    def write(self, flat: FlatParam, shard: torch.Tensor): ...


@dataclass
class ShardState:
    """One trainable FlatParam's optimizer state on this rank."""

    master: torch.Tensor  # fp32 weights; may alias the parameter shard in fp32 runs
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor  # fp32 gradient accumulator for this shard
    param_shard: torch.Tensor | None  # compute-dtype shard where the parameters live; None if not in memory
    step: int = 0
    has_grad: bool = False
    stepped: bool = False  # already stepped this step, as its gradient arrived (StreamedAdam)


class ShardedAdam(torch.optim.Optimizer):
    """Steps the shards of `flats`; `groups` gives each param group's lr, betas, eps and weight_decay."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        adamw_mode: bool,
        offloaded: bool,
        param_sink: ParamSink,
    ) -> None:
        """`groups` holds each param group's hyper-parameters; shards join them through `add_shard`."""
        self.adamw_mode = adamw_mode
        self.offloaded = offloaded
        self.param_sink = param_sink
        self._param_writes: deque = deque()
        self.shard_states: dict[FlatParam, ShardState] = {}
        super().__init__([{**hyper, "params": []} for hyper in groups], defaults={})
        self._torch_opt: torch.optim.Optimizer | None = None
        self.grad_bytes_to_host = 0

    def add_shard(self, flat: FlatParam, master: torch.Tensor, param_shard: torch.Tensor | None) -> None:
        """Take over one trainable FlatParam's fp32 master shard; moments start at zero."""
        self.shard_states[flat] = ShardState(
            master=master,
            exp_avg=torch.zeros_like(master),
            exp_avg_sq=torch.zeros_like(master),
            grad=torch.zeros_like(master),
            param_shard=param_shard,
        )
        self.param_groups[flat.group_index]["params"].append(master)

    # -- gradients -----------------------------------------------------------------------------

    def accumulate_grad(self, flat: FlatParam, shard_grad: torch.Tensor, final: bool = True) -> None:
        """Add one micro-batch's reduced gradient shard (fp32, any device) into the accumulator;
        `final` marks the last micro-batch before a step."""
        state = self.shard_states[flat]
        if self.offloaded:
            self.grad_bytes_to_host += shard_grad.numel() * shard_grad.element_size()
        if state.has_grad:
            state.grad.add_(shard_grad.to(state.grad.device, non_blocking=True))
        else:
            state.grad.copy_(shard_grad, non_blocking=True)
            state.has_grad = True

    def accumulate_param_grads(self, flat: FlatParam, final: bool = True) -> None:
        """One rank, nothing to reduce: add the parameters' gradients straight into the accumulator."""
        state = self.shard_states[flat]
        if state.grad.device != flat.full.device:  # e.g. CUDA compute, host optimizer: one flat copy over
            full = flat.flat_grad()
            if full is not None:
                self.accumulate_grad(flat, full, final)
            return
        if flat.grads_into(state.grad, accumulate=state.has_grad):
            state.has_grad = True
            if self.offloaded:
                self.grad_bytes_to_host += state.grad.numel() * state.grad.element_size()

    @property
    def step_in_progress(self) -> bool:
        """Whether some shards of the current step were stepped already (only StreamedAdam does that)."""
        return False

    def refuse_mid_step(self, what: str) -> None:
        """Raise if the optimizer is part way through a step; `what` names the refused operation."""
        if self.step_in_progress:
            raise RuntimeError(
                f"{what} between backward and step: the NVMe optimizer has already stepped some shards as "
                "their gradients arrived (no gradient clipping); call engine.step() first"
            )

    def local_grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards (fp64 scalar on CPU); inf/nan if they overflowed.

        Each shard's norm is taken in fp32 (an fp64 copy would double the shard's memory) and the
        squares are summed in double.
        """
        total = 0.0
        for state in self.shard_states.values():
            if state.has_grad:
                total += float(torch.linalg.vector_norm(state.grad)) ** 2
        return torch.tensor(total, dtype=torch.float64)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for state in self.shard_states.values():
            state.has_grad = False

    # -- the step ------------------------------------------------------------------------------

    def _group_of(self, flat: FlatParam) -> dict[str, Any]:
        return self.param_groups[flat.group_index]

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
        for flat, s in self.shard_states.items():
            if s.has_grad:
                s.step += 1
                self._adam_native(flat, s.step, s.master, s.grad, s.exp_avg, s.exp_avg_sq, s.param_shard, grad_scale)
        self.finish_param_writes()

    # Whether a master handed to `_adam_native` stays untouched until the returned write is done (then
    # an fp32 parameter shard is written from it directly instead of from a copy).
    _masters_outlive_writes = False

    def _adam_native(self, flat, step, master, grad, exp_avg, exp_avg_sq, param_shard, grad_scale: float):
        """One native Adam pass over a shard, then its new compute-dtype weights to where they live;
        returns the write of those weights when they go to NVMe (else None)."""
        from infinity.optim.cpu_adam import adam_step_flat

        group = self._group_of(flat)
        staging = None
        if param_shard is None and master.dtype != flat.full.dtype:
            staging = torch.empty(master.numel(), dtype=flat.full.dtype)
        fused_target = param_shard if param_shard is not None else staging
        fused = fused_target is not None and fused_target.dtype in (torch.bfloat16, torch.float16)
        fused = fused and fused_target.device.type == "cpu"
        adam_step_flat(
            master,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw_mode=self.adamw_mode,
            out_copy=fused_target if fused else None,
            grad_scale=grad_scale,
        )
        return self._publish_params(flat, master, param_shard, staging, fused)

    def _publish_params(self, flat, master, param_shard, staging, fused: bool):
        if param_shard is not None:
            if not fused and param_shard.data_ptr() != master.data_ptr():
                # a master that is a store buffer is released and reused once its writes are done
                param_shard.copy_(master, non_blocking=not self._masters_outlive_writes)
            self.param_sink.updated_in_place(flat)
            return None
        if staging is not None:
            source = staging
            if not fused:
                staging.copy_(master)
        else:
            source = master if self._masters_outlive_writes else master.clone()
        handle = self.param_sink.write(flat, source)
        self._param_writes.append((handle, source))
        while len(self._param_writes) > MAX_PARAM_WRITES_IN_FLIGHT:
            self._param_writes.popleft()[0].wait()
        return handle

    def finish_param_writes(self) -> None:
        """Wait for the parameter shards still being written to NVMe."""
        while self._param_writes:
            self._param_writes.popleft()[0].wait()

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
            self._torch_opt = cls([dict(g) for g in self.param_groups if g["params"]], fused=True)
            for s in self.shard_states.values():  # torch steps our moment buffers in place
                step = torch.full((), float(s.step), dtype=torch.float32, device=s.master.device)
                self._torch_opt.state[s.master] = {"step": step, "exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq}
        for mine, theirs in zip(
            [g for g in self.param_groups if g["params"]], self._torch_opt.param_groups, strict=True
        ):
            for key in ("lr", "betas", "eps", "weight_decay"):
                theirs[key] = mine[key]
        self._torch_opt.step()
        for flat, s in active:
            s.step += 1
            s.master.grad = None
            self._publish_params(flat, s.master, s.param_shard, None, fused=False)
        self.finish_param_writes()

    def read_state(self, flat: FlatParam) -> dict[str, torch.Tensor]:
        """Host copies of one shard's fp32 master and moments, wherever they live."""
        s = self.shard_states[flat]
        return {
            "master": s.master.cpu().clone(),
            "exp_avg": s.exp_avg.cpu().clone(),
            "exp_avg_sq": s.exp_avg_sq.cpu().clone(),
        }

    def load_state(self, flat: FlatParam, values: dict[str, torch.Tensor]) -> None:
        """Overwrite one shard's master and moments (e.g. from a checkpoint)."""
        s = self.shard_states[flat]
        with torch.no_grad():
            for name in ("master", "exp_avg", "exp_avg_sq"):
                getattr(s, name).copy_(values[name])
        if s.param_shard is not None and s.param_shard.data_ptr() == s.master.data_ptr():
            self.param_sink.updated_in_place(flat)

    def set_master(self, flat: FlatParam, master: torch.Tensor) -> None:
        """New fp32 weights for one shard (e.g. pretrained); its moments are kept."""
        values = self.read_state(flat)
        values["master"] = master
        self.load_state(flat, values)

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
