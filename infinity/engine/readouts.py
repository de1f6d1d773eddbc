"""What an engine reports about its run (DeepSpeed's getters and infinity's byte and wait counters), read
without changing anything: a mixin of `InfinityEngine`, kept apart from the training wiring."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch


class EngineReadouts:
    """The read-only half of the engine's API; see the module docstring."""

    @property
    def flats(self):
        return self.shards.flats

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.placement.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.placement.compute_device

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """The next `step()` steps the weights (the last micro-batch of an accumulation)."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def get_lr(self) -> list[float]:
        """Each param group's learning rate now (the client optimizer's, where it sets them)."""
        if self._client_is_truth:
            self._sync_hyperparameters(into_client=False)
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """DeepSpeed's: the global gradient norm of the last step (unscaled), where clipping or fp16 took it."""
        return self.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for an fp16 overflow."""
        return self.loss_scaler.skipped_steps

    @property
    def bytes_moved(self) -> dict[str, int]:
        """Bytes that moved between tiers since initialization, per "from->to" pair: parameter shards,
        optimizer state and gradients as the store moved them (cache hits move nothing), and gradients
        copied off the device."""
        moved = dict(self.moves.bytes)
        if self.shards.grad_bytes_to_host:
            moved["device->host"] = moved.get("device->host", 0) + self.shards.grad_bytes_to_host
        return moved

    @property
    def kept_buffer_bytes(self) -> int:
        """Host memory kept between uses for gathers, gradient reductions and held gradients, lent out or not
        (`comm.buffers`: under an explicit `host_budget_bytes`, the gathers' and a few gradient flats)."""
        return self.comm.buffers.kept_bytes

    @property
    def stall_s(self) -> float:
        """Seconds compute waited for a block's weights to arrive."""
        return self.scheduler.stall_s

    # -- DeepSpeed's engine getters, for scripts written against them ------------------------------------

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    dp_world_size = world_size  # every rank is a data-parallel rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's LOCAL_RANK; 0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", "0") or 0)

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    @property
    def global_samples(self) -> int:
        """Samples the optimizer steps so far stood for (skipped fp16 steps included, as DeepSpeed counts)."""
        return self.global_steps * self.config.train_batch_size

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def bfloat16_enabled(self) -> bool:
        return self.compute_dtype is torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.compute_dtype is torch.float16

    def was_step_applied(self) -> bool:
        """Whether the last `step()` changed the weights: False between accumulation boundaries and where an fp16
        overflow skipped the step, as DeepSpeed's."""
        return self._step_applied

    def get_mom(self) -> list[tuple[float, float]]:
        """Each param group's Adam betas now."""
        if self._client_is_truth:
            self._sync_hyperparameters(into_client=False)
        return [tuple(g["betas"]) for g in self.optimizer.param_groups]

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The module's parameters (sharded ones are empty between passes: `full_state_dict` has the weights)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse)
