"""Gradients of one block, from its parameters to this rank's optimizer shards."""

from __future__ import annotations

import time

import torch

from infinity.comm import CommGroup
from infinity.optim.sharded_adam import ShardedAdam
from infinity.partition.sharded_block import ShardedBlock


def reduce_block_grads(block: ShardedBlock, comm: CommGroup, optimizer: ShardedAdam, final: bool, prof) -> None:
    """Reduce-scatter the block's full gradients into this rank's shards, hand them to the optimizer and
    free them; `final` marks the last micro-batch before a step. `prof` records the collectives.

    With one rank the gradients are this rank's shard already: the one place that knows it, so they go
    to the accumulator in one pass instead of through a reduction."""
    for flat in block.flats:
        if not flat.requires_grad:
            continue
        if comm.world_size == 1:
            optimizer.accumulate_local_grads(flat, final)
            flat.clear_grads()
            continue
        full = flat.flat_grad()
        if full is None:  # every rank joins the collective, with or without gradients
            full = torch.zeros(flat.padded_numel, dtype=torch.float32, device=flat.full.device)
        shard = torch.empty(flat.shard_numel, dtype=torch.float32, device=flat.full.device)
        start = time.perf_counter_ns()
        comm.reduce_scatter_mean(shard, full, f"gradients of {flat.name}")
        prof.collective("reduce-scatter", block.name, full.numel() * 4, start, time.perf_counter_ns())
        optimizer.accumulate_grad(flat, shard, final)
        flat.clear_grads()
