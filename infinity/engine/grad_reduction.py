"""Gradients of one block, from its parameters to this rank's optimizer shards; and, for replicated
parameters (stages 1-2), the updated partitions back to every rank."""

from __future__ import annotations

import time

import torch

from infinity.comm import CommGroup
from infinity.optim.sharded_adam import ShardedAdam
from infinity.partition import FlatParam
from infinity.partition.sharded_block import ShardedBlock
from infinity.shards import GradReduction, ShardStore


class GradReducer:
    """Reduces each block's gradients into this rank's optimizer shards as its backward ends.

    Stages 2-3 reduce-scatter; stage 1 all-reduces and keeps this rank's slice (twice the bytes of a
    reduce-scatter for the same result: stage 2 is the better choice where a config allows it). Both
    reduce every micro-batch, so micro-batches are summed in the order plain PyTorch sums them. With one
    rank the gradients are this rank's shard already: the one place that knows it, so they go to the
    accumulator in one pass."""

    def __init__(self, comm: CommGroup, optimizer: ShardedAdam, reduction: GradReduction, prof) -> None:
        self.comm = comm
        self.optimizer = optimizer
        self.reduction = reduction
        self.prof = prof

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
        if self.reduction is GradReduction.REDUCE_SCATTER:
            shard = torch.empty(flat.shard_numel, dtype=torch.float32, device=full.device)
            self.comm.reduce_scatter_mean(shard, full, f"gradients of {flat.name}")
        else:
            begin, end = flat.shard_range
            shard = self.comm.all_reduce(full, f"gradients of {flat.name}")[begin:end].div_(self.comm.world_size)
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
