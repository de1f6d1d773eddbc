"""Byte budgets per tier for a run, derived from DeepSpeed's offload buffer settings or given explicitly."""

from __future__ import annotations

import math

from infinity.config import ConfigError, ZeroConfig
from infinity.partition import BlockPlan
from infinity.partition.flat_param import SHARD_ALIGN_ELEMS
from infinity.storage import TierBudgets


def plan_budgets(
    z: ZeroConfig, plan: BlockPlan, world_size: int, itemsize: int, param_tier: str, optim_tier: str
) -> tuple[TierBudgets, int]:
    """Byte budgets per tier, and how many shards' optimizer state the NVMe step streams at once.

    Host memory is bounded whenever no shard lives there: parameters need room for one shard being
    gathered and one being written (`offload_param.buffer_count` x `buffer_size` for read-ahead
    by default); the streamed optimizer needs 16 bytes per element (master, moments, gradient)
    for each shard in its window, plus one gradient shard being accumulated.
    """
    sizes = [sum(p.numel() for _, p, _ in uses) for uses in (plan.root, plan.persistent)]
    sizes += [sum(p.numel() for _, p, _ in uses) for _, _, uses in plan.blocks]
    largest = math.ceil(max(sizes, default=0) / world_size) + SHARD_ALIGN_ELEMS
    param_min = 2 * largest * itemsize if param_tier == "nvme" else 0
    optim_shard, grad_rmw = 16 * largest, 4 * largest if optim_tier == "nvme" else 0
    window = z.offload_optimizer.buffer_count
    host = z.host_budget_bytes
    bounded = "host" not in (param_tier, optim_tier) and "nvme" in (param_tier, optim_tier)
    if host is None and bounded:
        host = grad_rmw
        if param_tier == "nvme":
            elems = max(z.offload_param.buffer_count * z.offload_param.buffer_size, 4 * largest)
            host += max(min(elems, z.offload_param.max_in_cpu or elems), 4 * largest) * itemsize
        if optim_tier == "nvme":
            host += (window + 1) * optim_shard
    elif host is not None and bounded:
        room = host - param_min - grad_rmw
        if optim_tier == "nvme":
            window = min(window, room // optim_shard)
        if room < 0 or window < 1:
            need = param_min + grad_rmw + (optim_shard if optim_tier == "nvme" else 0)
            raise ConfigError(
                f"'zero_optimization.host_budget_bytes' is {host}; the largest block's shard ({largest} "
                f"elements) needs at least {need} bytes of host memory to stream through: raise the budget"
            )
    return TierBudgets(device_bytes=z.device_budget_bytes, host_bytes=host), window
