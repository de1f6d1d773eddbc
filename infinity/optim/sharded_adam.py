"""ShardedAdam: Adam/AdamW over this rank's shards, the `torch.optim.Optimizer` face of a stepper.

It holds the hyper-parameters per param group (`param_groups`, so LR schedulers drive it as usual)
and routes each gradient shard: into the shard store's accumulator, or, where the placement steps
shards during backward, to the stepper as it arrives. The bytes (masters, moments, accumulators)
belong to the shard store; the step is the stepper's (`optim.steppers`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from infinity.optim.param_steps import any_used
from infinity.optim.steppers import NativeStepper, Stepper
from infinity.optim.torch_stepper import TorchFusedStepper
from infinity.partition.flat_param import FlatParam
from infinity.shards.policy import StepperKind, StepTiming
from infinity.shards.store import ShardStore
from infinity.storage import ALIGN


class ShardedAdam(torch.optim.Optimizer):
    """Steps the shards of every trainable flat in `shards`; `groups` holds each param group's lr, betas,
    eps and weight_decay (a flat's `group_index` names its group). `param_groups` hold no tensors."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        adamw_mode: bool,
        shards: ShardStore,
        window: int = 4,
        prof=None,
        pipeline: tuple[bool, bool] = (True, True),
    ) -> None:
        """`window`: shards the native stepper holds in host memory at once (`offload_optimizer.buffer_count`);
        `prof`: the trace writer the stepper records its waits and arithmetic into; `pipeline`: the native
        stepper's (read ahead, write behind) (`offload_optimizer.pipeline_read`, `pipeline_write`)."""
        self.adamw_mode = adamw_mode
        self.shards = shards
        self.step_in_backward = shards.placement.step_in_backward
        self.step_deferred = shards.placement.step_timing is StepTiming.BEFORE_NEXT_GATHER
        self._expecting_defer = False  # this backward's deferred step was prepared for (`expect_defer`)
        self._replaying = False  # gradients handed over are recomputed for a deferred step (`replaying`)
        self.engine_step: Callable[[], None] | None = None  # what `step()` runs: set by the engine that owns it
        super().__init__([{**hyper, "params": []} for hyper in groups], defaults={})
        self.stepper: Stepper = (
            TorchFusedStepper(shards, self.hyper, adamw_mode)
            if shards.placement.stepper is StepperKind.TORCH
            else NativeStepper(shards, self.hyper, adamw_mode, window, prof, *pipeline)
        )

    # -- gradients -----------------------------------------------------------------------------

    def accumulate_grad(
        self,
        flat: FlatParam,
        shard_grad: torch.Tensor,
        final: bool = True,
        present: tuple[bool, ...] | torch.Tensor | None = None,
    ) -> None:
        """One micro-batch's reduced gradient shard (fp32, any device); `final` marks the last one before a step;
        `present`: the ranks' agreed presence of the flat's parameters' gradients (1 where), if agreed now."""
        if self._replaying and not self.shards.expects_replayed_grad(flat):
            return
        if present is not None and not self._replaying:
            self.shards.agreed_grad_presence(flat, present)
        if final:
            self._final_grad_arrives()
        if final and self.step_in_backward:
            grad = self.shards.final_grad(flat, shard_grad)
            if any_used(self.shards.grad_presence(flat)):  # else nothing to step (nor to keep)
                self.stepper.arrive(flat, grad)
        else:
            self.shards.accumulate_grad(flat, shard_grad, final)

    def note_grad_presence(self, flat: FlatParam, present: tuple[bool, ...]) -> None:
        """Which of `flat`'s parameters got a gradient in this micro-batch on this rank (not in a replay: those
        are the step's own gradients again)."""
        if not self._replaying:
            self.shards.note_grad_presence(flat, present)

    def accumulate_local_grads(self, flat: FlatParam, final: bool = True, out: torch.Tensor | None = None) -> None:
        """One rank, nothing to reduce: the parameters' gradients go straight into the accumulator when it
        is in the compute's memory (one pass), else through one flat copy; where only their norm is kept (the
        step recomputes them), it is read from them. `out`: `local_grad_buffer(flat)`, taken ahead and holding
        some of the gradients already (written there as views: those are not copied again)."""
        if self._replaying and not self.shards.expects_replayed_grad(flat):
            return
        acc = self._accumulator_in_compute_memory(flat, final)
        if acc is not None:
            if final:
                self._final_grad_arrives()
            if flat.grads_into(acc, accumulate=self.shards.records[flat].has_grad):
                self.shards.grad_written(flat, final)
            return
        if final and not self.step_in_backward:
            self._final_grad_arrives()
            if self.shards.owe_replay_of_params(flat):  # only its norm is kept (its step recomputes it): no flat
                return
        full = flat.flat_grad(out if out is not None else self.local_grad_buffer(flat, final))
        if full is not None:
            self.accumulate_grad(flat, full, final)

    def local_grad_buffer(self, flat: FlatParam, final: bool = True) -> torch.Tensor | None:
        """The padded flat `accumulate_local_grads` copies `flat`'s gradients into, for a caller that makes them
        there itself (a replay's products); None where they go straight into an accumulator instead. On a
        device it is fp32. On the host it is 4 KiB-aligned so that an NVMe accumulator writes it in place (no
        staging copy), in the dtype the accumulator keeps, on memory reused step after step (one rank's
        reduction buffer): fresh memory costs the kernel's zeroing on first touch, the largest part of a copy."""
        if self._accumulator_in_compute_memory(flat, final) is not None:
            return None
        if flat.full.device.type != "cpu":
            return torch.empty(flat.padded_numel, dtype=torch.float32, device=flat.full.device)
        dtype = self.shards.placement.grad_dtype
        return self.shards.comm.buffers.take(flat.padded_numel, dtype, flat.full.device, align=ALIGN)

    def _accumulator_in_compute_memory(self, flat: FlatParam, final: bool) -> torch.Tensor | None:
        """`flat`'s gradient accumulator where the gradients are summed into it in place (one pass)."""
        acc = self.shards.grad_accumulator(flat)
        if acc is not None and acc.device == flat.full.device and not (final and self.step_in_backward):
            return acc
        return None

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """The gradients handed over meanwhile are recomputed for a deferred step (the engine's `GradientReplay`),
        not a backward's: no step is about to be deferred for them."""
        expecting, self._expecting_defer = self._expecting_defer, True
        replaying, self._replaying = self._replaying, True
        try:
            yield
        finally:
            self._expecting_defer = expecting
            self._replaying = replaying

    def _final_grad_arrives(self) -> None:
        """The first final gradient of a step whose step will be deferred: the stepper prepares for it."""
        if self.step_deferred and not self._expecting_defer:
            self._expecting_defer = True
            self.stepper.expect_defer()

    def local_grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's gradient shards (fp64 scalar on CPU); inf/nan if they overflowed."""
        return torch.tensor(self.shards.local_grad_norm_sq(), dtype=torch.float64)

    @property
    def step_in_progress(self) -> bool:
        """Some shards of the current step were stepped already (as their gradients arrived)."""
        return self.stepper.in_progress

    @property
    def stepped_in_backward(self) -> int:
        return self.stepper.stepped_in_backward

    @property
    def stepped_when_needed(self) -> int:
        """Shards whose step was deferred and ran when they were next needed (0 for the torch stepper)."""
        return getattr(self.stepper, "stepped_when_needed", 0)

    def refuse_mid_step(self, what: str) -> None:
        """Raise if the optimizer is part way through a step; `what` names the refused operation."""
        if self.step_in_progress:
            raise RuntimeError(
                f"{what} between backward and step: the NVMe optimizer has already stepped some shards as "
                "their gradients arrived (no gradient clipping); call engine.step() first"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.refuse_mid_step("zero_grad")
        self.shards.zero_grad()
        self._expecting_defer = False  # a step skipped (fp16 overflow) deferred nothing

    # -- the step ------------------------------------------------------------------------------

    def hyper(self, group_index: int) -> dict[str, Any]:
        return self.param_groups[group_index]

    def step(self, closure=None) -> None:
        """The step a user calls: the engine's whole step where an engine owns this optimizer (`engine_step`:
        clipping, fp16 unscaling, the schedule), else `step_shards` as they are."""
        if closure is not None:
            raise ValueError("ShardedAdam.step does not take a closure")
        if self.engine_step is not None:
            self.engine_step()
        else:
            self.step_shards()

    @torch.no_grad()
    def step_shards(self, grad_scale: float = 1.0, order: list[FlatParam] | None = None) -> None:
        """One Adam step on every shard with a gradient, gradients multiplied by `grad_scale` first.

        Where the placement defers steps until the next gather, each shard is owed its step (with the
        hyper-parameters as they are now) and stepped when next needed; `order` is the order the next
        forward needs them in (default: the store's)."""
        self.shards.agree_grad_presence()
        flats = [
            f for f, record in self.shards.records.items() if record.has_grad and any_used(self.shards.grad_presence(f))
        ]
        if self.shards.placement.step_timing is StepTiming.BEFORE_NEXT_GATHER:
            rank = {f: i for i, f in enumerate(order or flats)}
            flats.sort(key=lambda f: rank.get(f, len(rank)))
            self.stepper.defer(flats, grad_scale, [dict(g) for g in self.param_groups])
            self._expecting_defer = False
        else:
            self.stepper.step(flats, grad_scale)

    @staticmethod
    def clip_coefficient(norm: float, max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
        if max_norm <= 0 or not math.isfinite(norm):
            return 1.0
        return min(1.0, max_norm / (norm + 1e-6))
