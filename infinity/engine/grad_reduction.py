"""Gradients of one block, from its parameters to this rank's optimizer shards; and, for replicated
parameters (stages 1-2), the updated partitions back to every rank."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from infinity.comm import CommGroup
from infinity.optim.sharded_adam import ShardedAdam
from infinity.partition import FlatParam
from infinity.partition.sharded_block import ShardedBlock
from infinity.shards import GradReduction, ShardStore


@dataclass(frozen=True)
class GradScaling:
    """Where the division by the world size happens around the sum over ranks (DeepSpeed's
    `prescale_gradients` and `gradient_predivide_factor`, as its engine's all-reduce applies them): prescaled,
    all of it before; otherwise by the predivide factor before and by world size / factor after. The result
    is the mean either way; pre-dividing keeps large sums in range."""

    before: float  # divisor applied to this rank's gradients before the sum
    after: float  # divisor applied to the sum

    @staticmethod
    def from_config(prescale: bool, predivide_factor: float, world_size: int) -> GradScaling:
        if prescale:
            return GradScaling(float(world_size), 1.0)
        return GradScaling(predivide_factor, world_size / predivide_factor)


class GradReducer:
    """Reduces each block's gradients into this rank's optimizer shards as its backward ends.

    Stages 2-3 reduce-scatter; stage 1 all-reduces and keeps this rank's slice (twice the bytes of a
    reduce-scatter for the same result: stage 2 is the better choice where a config allows it). Both
    reduce every micro-batch, so micro-batches are summed in the order plain PyTorch sums them. With one
    rank the gradients are this rank's shard already: the one place that knows it, so they go to the
    accumulator in one pass."""

    def __init__(
        self,
        comm: CommGroup,
        optimizer: ShardedAdam,
        reduction: GradReduction,
        prof,
        scaling: GradScaling | None = None,
    ) -> None:
        self.comm = comm
        self.optimizer = optimizer
        self.reduction = reduction
        self.prof = prof
        self.scaling = scaling or GradScaling(1.0, float(comm.world_size))

    def reduce_block(self, block: ShardedBlock, final: bool) -> None:
        """Hand the block's gradients over and free them; `final` marks the last micro-batch before a step."""
        for flat in block.flats:
            if not flat.requires_grad:
                continue
            if self.comm.world_size == 1:
                self.optimizer.accumulate_local_grads(flat, final)
            else:
                self.optimizer.accumulate_grad(flat, self._reduce(block.name, flat), final)
            flat.clear_grads()

    def _reduce(self, block_name: str, flat: FlatParam) -> torch.Tensor:
        """This rank's shard of the mean of every rank's gradients of `flat` (fp32)."""
        full = flat.flat_grad()
        if full is None:  # every rank joins the collective, with or without gradients
            full = torch.zeros(flat.padded_numel, dtype=torch.float32, device=flat.full.device)
        start = time.perf_counter_ns()
        if self.scaling.before != 1.0:
            full.div_(self.scaling.before)
        if self.reduction is GradReduction.REDUCE_SCATTER:
            shard = torch.empty(flat.shard_numel, dtype=torch.float32, device=full.device)
            self.comm.reduce_scatter_sum(shard, full, f"gradients of {flat.name}")
        else:
            begin, end = flat.shard_range
            shard = self.comm.all_reduce(full, f"gradients of {flat.name}")[begin:end]
        if self.scaling.after != 1.0:
            shard.div_(self.scaling.after)
        self.prof.collective(self.reduction.value, block_name, full.numel() * 4, start, time.perf_counter_ns())
        return shard


@torch.no_grad()
def share_updated_partitions(shards: ShardStore, prof) -> None:
    """Replicated parameters (stages 1-2, several ranks): each rank stepped its own range of every flat;
    all-gather the ranges so every rank's parameters hold the new weights (in the compute dtype)."""
    if not shards.placement.params_resident or shards.comm.world_size == 1:
        return
    for flat in shards.flats:
        if flat.requires_grad:
            start = time.perf_counter_ns()
            shards.sync_resident(flat)
            prof.collective(
                "all-gather", flat.name, flat.full.numel() * flat.full.element_size(), start, time.perf_counter_ns()
            )
