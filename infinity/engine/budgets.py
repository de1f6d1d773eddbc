"""Byte budgets per tier for a run, derived from DeepSpeed's offload buffer settings or given explicitly."""

from __future__ import annotations

import math
from dataclasses import dataclass

from infinity.config import ConfigError, ZeroConfig
from infinity.partition import BlockPlan
from infinity.partition.flat_param import SHARD_ALIGN_ELEMS
from infinity.storage import TierBudgets


@dataclass(frozen=True)
class BudgetPlan:
    budgets: TierBudgets
    optimizer_window: int  # shards whose optimizer state the NVMe step streams at once
    param_read_ahead_bytes: int | None  # NVMe parameter shards read ahead into host memory; None: no cap


def plan_budgets(
    z: ZeroConfig,
    plan: BlockPlan,
    world_size: int,
    itemsize: int,
    param_tier: str,
    optim_tier: str,
    compute_in_host_memory: bool = False,
) -> BudgetPlan:
    """Byte budgets per tier, the optimizer's streaming window and the parameters' read-ahead.

    Host memory is bounded whenever no shard lives there: parameters need room for one shard being
    gathered and one being written (`offload_param.buffer_count` x `buffer_size` for read-ahead
    by default); the streamed optimizer needs 16 bytes per element (master, moments, gradient)
    for each shard in its window, plus one gradient shard being accumulated. Parameter read-ahead
    gets what the optimizer leaves, so neither evicts the other's reads. With
    `compute_in_host_memory` (a CPU-only machine without a device budget) an explicit host budget
    also covers the compute's working set: gathered blocks and their gradients, taken off the top.
    """
    sizes = [sum(p.numel() for _, p, _ in uses) for uses in (plan.root, plan.persistent)]
    sizes += [sum(p.numel() for _, p, _ in uses) for _, _, uses in plan.blocks]
    largest = math.ceil(max(sizes, default=0) / world_size) + SHARD_ALIGN_ELEMS
    # NVMe parameters: one shard being gathered and one being written; where gathers read the host copies
    # (compute in host memory), those are held from the prefetch to the gather: a bucket's worth more.
    held = math.ceil(min(z.stage3_prefetch_bucket_size, sum(sizes)) / world_size) if compute_in_host_memory else 0
    param_min = (held + 2 * largest) * itemsize if param_tier == "nvme" else 0
    optim_shard, grad_rmw = 16 * largest, 4 * largest if optim_tier == "nvme" else 0
    window = z.offload_optimizer.buffer_count
    host = z.host_budget_bytes
    bounded = "host" not in (param_tier, optim_tier) and "nvme" in (param_tier, optim_tier)
    read_ahead = None
    if host is None and bounded:
        host = grad_rmw
        if param_tier == "nvme":
            elems = max(z.offload_param.buffer_count * z.offload_param.buffer_size, 4 * largest)
            read_ahead = max(min(elems, z.offload_param.max_in_cpu or elems), 4 * largest) * itemsize
            host += read_ahead
        if optim_tier == "nvme":
            host += (window + 1) * optim_shard
    elif host is not None and bounded:
        full_block = largest * world_size
        # Gathered blocks (the current one, the next, one being reduced) and their gradients: autograd's,
        # the flat copy, and those waiting for the optimizer (half its window).
        working = 3 * full_block * itemsize + (2 + window // 2) * full_block * 4 if compute_in_host_memory else 0
        room = host - working - param_min - grad_rmw
        if optim_tier == "nvme":
            window = min(window, room // optim_shard)
        if room < 0 or window < 1:
            need = working + param_min + grad_rmw + (optim_shard if optim_tier == "nvme" else 0)
            raise ConfigError(
                f"'zero_optimization.host_budget_bytes' is {host}; the largest block's shard ({largest} "
                f"elements) needs at least {need} bytes of host memory to stream through: raise the budget"
            )
        host -= working
        if param_tier == "nvme":
            read_ahead = host - grad_rmw - (window * optim_shard if optim_tier == "nvme" else 0)
    return BudgetPlan(TierBudgets(device_bytes=z.device_budget_bytes, host_bytes=host), window, read_ahead)
