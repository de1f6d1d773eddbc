"""Which knob values change this run, so that tune never spends a trial on a value that changes nothing.

The offload buffer counts act only through the budget plan (`engine.memory_plan.plan_memory`):
`offload_param.buffer_count` sizes the NVMe parameter read-ahead, and only when no explicit
`host_budget_bytes` is set and no shard lives on the host (the read-ahead is also never below four of
the largest shards, and one above every parameter shard reads no more); `offload_optimizer.buffer_count`
is the NVMe optimizer's window, capped by an explicit host budget. For these knobs `effective_knob` keeps
one ladder value per distinct plan (the starting value for its own plan) and drops the knob when every
value gives the starting plan. The other knobs act on the run directly wherever `knobs.applicable` lets
them be searched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from infinity.config import InfinityConfig
from infinity.engine.memory_plan import MemoryPlan, largest_shard_elems, plan_memory
from infinity.partition import BlockPlan
from infinity.partition.flat_param import SHARD_ALIGN_ELEMS
from infinity.shards import resolve_placement
from infinity.tuning.knobs import OPTIMIZER_BUFFERS, PARAM_BUFFERS, Knob

PLAN_KNOBS = (PARAM_BUFFERS, OPTIMIZER_BUFFERS)


def with_value(cfg: Any, name: str, value: Any) -> Any:
    """`cfg` (a frozen config dataclass) with the dotted key `name` set to `value`."""
    head, _, rest = name.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: with_value(getattr(cfg, head), rest, value)})


def budget_plan(cfg: InfinityConfig, plan: BlockPlan, device: torch.device, world_size: int = 1) -> MemoryPlan:
    """The memory plan the engine would make for `cfg` (resolved) and the model's `plan` on `device`."""
    placement = resolve_placement(cfg, device, world_size, client_optimizer=False)
    return plan_memory(cfg.zero_optimization, plan, placement)


def _as_run(result: MemoryPlan, plan: BlockPlan, itemsize: int) -> MemoryPlan:
    """`result` as the run feels it: a parameter read-ahead beyond every parameter shard reads nothing more,
    and the host budget's share above that is never used (the small models' case: the default read-ahead of
    5 x 1e8 elements holds all their parameters at any buffer_count)."""
    ahead = result.param_read_ahead_bytes
    every_shard = (largest_shard_elems(plan, 1)[1] + (len(plan.blocks) + 2) * SHARD_ALIGN_ELEMS) * itemsize
    if ahead is None or ahead <= every_shard or result.budgets.host_bytes is None:
        return result
    host = result.budgets.host_bytes - (ahead - every_shard)
    return dataclasses.replace(
        result, budgets=dataclasses.replace(result.budgets, host_bytes=host), param_read_ahead_bytes=every_shard
    )


def _why_not(cfg: InfinityConfig, name: str) -> str:
    z = cfg.zero_optimization
    if z.host_budget_bytes is not None and name == PARAM_BUFFERS:
        return "zero_optimization.host_budget_bytes is set, and it sizes host memory instead"
    if "cpu" in (z.offload_param.device, z.offload_optimizer.device) and name == PARAM_BUFFERS:
        return "a shard lives on the host, so host memory is not budgeted and the read-ahead is not capped"
    if name == PARAM_BUFFERS:
        return ("the read-ahead is the same at every value on its ladder: never below four of the largest shards, "
                "and none above every parameter shard reads more")
    return "every value on its ladder gives the same budget plan"


def effective_knob(knob: Knob, cfg: InfinityConfig, plan: BlockPlan, device: torch.device) -> tuple[Knob | None, str]:
    """(`knob` with only the values that change the budget plan, or None; why it was dropped)."""
    if knob.name not in PLAN_KNOBS:
        return knob, ""
    start = knob.read(cfg.to_dict())
    itemsize = torch.empty((), dtype=getattr(torch, cfg.compute_dtype_name)).element_size()
    groups: list[tuple[MemoryPlan, list[int]]] = []
    for value in sorted(set(knob.ladder) | {start}):
        try:
            result = _as_run(budget_plan(with_value(cfg, knob.name, value), plan, device), plan, itemsize)
        except ValueError:  # the value does not fit an explicit host budget: a trial would fail
            continue
        for seen, values in groups:
            if seen == result:
                values.append(value)
                break
        else:
            groups.append((result, [value]))
    if len(groups) <= 1:
        return None, f"not tuning {knob.name}: it changes nothing here ({_why_not(cfg, knob.name)})"
    ladder = tuple(sorted(start if start in values else min(values) for _, values in groups))
    return Knob(knob.name, ladder, knob.aliases), ""
