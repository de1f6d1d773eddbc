"""The memory plan of a run: byte budgets per tier, summed from what each pipeline declares it holds.

Pipelines state their own bounds: `NativeStepper.host_bytes` (the optimizer's window),
`BlockScheduler.working_set_bytes` (gathered blocks and their gradients, when the compute reads host
memory), `ShardStore.gather_host_bytes` and `ShardStore.grad_accumulation_bytes` (parameter shards
in flight, the NVMe gradient read-modify-write). The plan adds them up, and gives the parameters'
read-ahead what is left, so neither the optimizer's reads nor the parameters' evict the other's.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from infinity.config import ConfigError, InfinityConfig, ZeroConfig
from infinity.estimator.machine import available_host_bytes
from infinity.optim.steppers import NativeStepper
from infinity.partition import BlockPlan
from infinity.partition.blocks import flat_groups
from infinity.partition.flat_param import SHARD_ALIGN_ELEMS, FlatParam
from infinity.scheduler import BlockScheduler
from infinity.shards.moments import moment_format
from infinity.shards.policy import Placement, StepTiming, resolve_placement
from infinity.shards.store import ShardStore
from infinity.storage import ALIGN, Tier, TierBudgets


@dataclass(frozen=True)
class MemoryPlan:
    budgets: TierBudgets
    optimizer_window: int  # shards whose optimizer state the native stepper holds at once
    param_read_ahead_bytes: int | None  # NVMe parameter shards read ahead into host memory; None: no cap
    # freed compute buffers kept for reuse (`host_memory.keep_freed_blocks`): autograd's gradients of the
    # largest block (which the working set counts where the budget covers the compute); 0 on a GPU
    freed_block_bytes: int = 0


def largest_shard_elems(plan: BlockPlan, world_size: int) -> tuple[int, int, int]:
    """(the largest block's shard in elements, padding allowance included; all parameters' elements; the
    elements of the root's and persistent parameters, gathered for a whole pass)."""
    always = [sum(p.numel() for _, p, _ in uses) for uses in (plan.root, plan.persistent)]
    sizes = always + [sum(p.numel() for _, p, _ in uses) for _, _, uses in plan.blocks]
    return math.ceil(max(sizes, default=0) / world_size) + SHARD_ALIGN_ELEMS, sum(sizes), sum(always)


def _all_uses(plan: BlockPlan) -> list[list]:
    return [*(b[2] for b in plan.blocks), plan.root, plan.persistent]


def largest_flat_shard_elems(plan: BlockPlan, group_of: dict[int, int], world_size: int, sub_group_elems: int) -> int:
    """The largest trainable flat's shard in elements (`flat_groups`): the optimizer's unit of work."""
    flats = [run for uses in _all_uses(plan) for _, group, run in flat_groups(uses, group_of, sub_group_elems)]
    numels = [sum(p.numel() for _, p, _ in run) for run in flats] or [0]
    return FlatParam.shard_elems(max(numels), world_size)


def trainable_flats(plan: BlockPlan, group_of: dict[int, int], sub_group_elems: int) -> int:
    """How many flats have optimizer state (a param group): the shards an optimizer step streams."""
    groups = [group for uses in _all_uses(plan) for _, group, _ in flat_groups(uses, group_of, sub_group_elems)]
    return sum(group is not None for group in groups)


def deferred_step_window(buffer_count: int, flats: int, shard_state_bytes: int, spare_host_bytes: int) -> int:
    """The NVMe optimizer's window (shards of state in host memory at once) for a step deferred into the next
    forward, without a host budget: `buffer_count`, grown toward every flat as far as `spare_host_bytes` holds
    their state (`shard_state_bytes` each, the largest's). The step's reads then run during the backward
    before it (`NativeStepper.expect_defer`) and the forward only writes the state back; with a few shards
    that forward did nearly all of the step's I/O while the disk idled through backward."""
    fits = spare_host_bytes // shard_state_bytes - 1 if shard_state_bytes else 0  # host_bytes holds window + 1
    return max(buffer_count, min(flats, fits))


def plan_memory(
    z: ZeroConfig,
    plan: BlockPlan,
    placement: Placement,
    group_of: dict[int, int] | None = None,
    spare_host_bytes: int = 0,
    recompute_gradients: bool = False,
) -> MemoryPlan:
    """Byte budgets per tier, the optimizer's window and the parameters' read-ahead.

    Host memory is bounded whenever no shard lives there but some live on NVMe. Without an explicit
    `host_budget_bytes` the bound is the sum of the pipelines' needs, read-ahead sized by
    `offload_param.buffer_count` x `buffer_size`, and a deferred NVMe step's window grows into
    `spare_host_bytes` (`deferred_step_window`); with one, the optimizer's window shrinks to fit what
    the others leave, and read-ahead gets the rest. With the compute in host memory (a CPU-only machine
    without a device budget) an explicit host budget also covers the compute's working set, and with
    `recompute_gradients` (`grad_replay`) the gradients of the block replayed for the step.
    """
    world, itemsize = placement.world_size, placement.compute_dtype.itemsize
    largest, total, always_gathered = largest_shard_elems(plan, world)
    # the optimizer streams flats (sub-groups of `sub_group_size` elements at most), not whole blocks
    optim_largest = largest_flat_shard_elems(plan, group_of or {}, world, z.sub_group_size)
    param_on_nvme = placement.param_home is Tier.NVME
    optim_on_nvme = placement.optim_home is Tier.NVME
    # where gathers read host copies, the prefetch bucket's shards are held from their fetch to their gather
    held = math.ceil(min(z.stage3_prefetch_bucket_size, total) / world) if placement.compute_in_host_memory else 0
    param_min = ShardStore.gather_host_bytes(largest, held, itemsize) if param_on_nvme else 0
    window = z.offload_optimizer.buffer_count
    kept = 0  # backward gathers' copies the step reads a few blocks later (`ShardStore.release_param`)
    if param_on_nvme and placement.master_is_param and placement.step_in_backward and placement.compute_in_host_memory:
        kept = ShardStore.kept_param_bytes(largest, optim_largest, window // 2)
    grad_rmw = ShardStore.grad_accumulation_bytes(optim_largest) if optim_on_nvme else 0
    shard_state = NativeStepper.shard_state_bytes(optim_largest, placement.moments)
    host = z.host_budget_bytes
    bounded = Tier.HOST not in (placement.param_home, placement.optim_home) and (param_on_nvme or optim_on_nvme)
    read_ahead = None
    freed = largest * world * 4 if placement.compute_device.type == "cpu" else 0
    if host is None and bounded:
        host = grad_rmw + kept
        if param_on_nvme:
            elems = max(z.offload_param.buffer_count * z.offload_param.buffer_size, 4 * largest)
            read_ahead = max(min(elems, z.offload_param.max_in_cpu), 4 * largest) * itemsize
            host += read_ahead
        if optim_on_nvme:
            if placement.step_timing is StepTiming.BEFORE_NEXT_GATHER:
                flats = trainable_flats(plan, group_of or {}, z.sub_group_size)
                window = deferred_step_window(window, flats, shard_state, spare_host_bytes)
            host += NativeStepper.host_bytes(window, optim_largest, placement.moments)
    elif host is not None and bounded:
        working = 0
        if placement.compute_in_host_memory:
            # the bucket gathers blocks ahead: never more than the blocks hold (root and persistent are apart)
            bucket = min(z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters, total - always_gathered)
            waiting = window if optim_on_nvme else 0  # gradients wait in the native stepper's window on NVMe only
            working = BlockScheduler.working_set_bytes(largest * world, bucket, itemsize, waiting)
            working += always_gathered * itemsize
            if recompute_gradients:  # its weights gathered take the slot of a block being reduced (none in forward)
                working += largest * placement.grad_dtype.itemsize
        room = host - working - param_min - grad_rmw
        if optim_on_nvme:
            window = min(window, room // shard_state)
        if room < 0 or window < 1:
            need = working + param_min + grad_rmw + (shard_state if optim_on_nvme else 0)
            ahead = BlockScheduler.prefetched_bytes_bound(largest * world, bucket, itemsize) if working else 0
            raise ConfigError(
                f"'zero_optimization.host_budget_bytes' is {host}; the largest block's shard ({largest} elements) "
                f"needs at least {need} bytes of host memory to stream through, {ahead} of them for the weights "
                "gathered ahead: raise the budget, or lower 'zero_optimization.stage3_prefetch_bucket_size' (the "
                "weights gathered ahead) or 'zero_optimization.sub_group_size' (the optimizer's pieces)"
            )
        host -= working
        if param_on_nvme:
            # the kept copies save reads only where they fit: they come out of the read-ahead, not the minimum
            read_ahead = max(0, host - grad_rmw - kept - (window * shard_state if optim_on_nvme else 0))
    return MemoryPlan(TierBudgets(device_bytes=z.device_budget_bytes, host_bytes=host), window, read_ahead, freed)


def spare_host_bytes(z: ZeroConfig, placement: Placement, held_grad_bytes: int, available: int | None = None) -> int:
    """Host memory a run without `host_budget_bytes` may spend beyond its pipelines' minimum: a quarter of the
    memory `available` at start (MemAvailable), shared by the node's ranks, less the gradients held in it
    (`grads_wait_in_host`); 0 under an explicit budget or where the optimizer is not on NVMe."""
    if placement.optim_home is not Tier.NVME or z.host_budget_bytes is not None:
        return 0
    available = available_host_bytes() if available is None else available
    return max(0, available // (4 * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) - held_grad_bytes)


def balance_step_timing(
    cfg: InfinityConfig,
    placement: Placement,
    plan: BlockPlan,
    group_of: dict[int, int],
    client_optimizer: bool,
    available: int | None = None,
) -> Placement:
    """The placement to run. An NVMe step that would run during backward is deferred into the next forward
    instead where no `host_budget_bytes` is set and the gradients it then waits for fit in host memory
    (`grads_wait_in_host`): backward reads its state (`deferred_step_window`) and the forward writes it back,
    where stepping during backward moved all of it in backward while the forward only read parameters."""
    z = cfg.zero_optimization
    if placement.step_timing is not StepTiming.DURING_BACKWARD or z.host_budget_bytes is not None:
        return placement
    deferred = resolve_placement(cfg, placement.compute_device, placement.world_size, client_optimizer, defer_step=True)
    if deferred.step_timing is not StepTiming.BEFORE_NEXT_GATHER:
        return placement
    layout = (plan, group_of, deferred, cfg.gradient_accumulation_steps, z.sub_group_size)
    waiting = home_bytes(*layout)[Tier.NVME] - home_bytes(*layout, grads_in_host=True)[Tier.NVME]
    return deferred if grads_wait_in_host(z, deferred, waiting, available) else placement


def grads_wait_in_host(z: ZeroConfig, placement: Placement, waiting_bytes: int, available: int | None = None) -> bool:
    """Whether the gradients that wait for their step on an NVMe optimizer (clipping, fp16, accumulation;
    `waiting_bytes` of them per rank) stay in host memory instead, never touching the disk, as DeepSpeed keeps
    them: without `host_budget_bytes`, where they fit in the spare host memory (`spare_host_bytes`). Under an
    explicit budget they wait on NVMe: the budget is the streaming's."""
    return 0 < waiting_bytes <= spare_host_bytes(z, placement, 0, available)


def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def home_bytes(
    plan: BlockPlan,
    group_of: dict[int, int],
    placement: Placement,
    grad_accumulation: int,
    sub_group_elems: int,
    grads_in_host: bool = False,
) -> dict[Tier, int]:
    """Per tier, the bytes this rank's shards take in their homes, as `shard_model` lays them out (one flat
    per block and param group; host and NVMe slots padded to 4 KiB as the buffer pool and the swap file
    pad them): what the swap file is sized to, and what an explicit host budget must hold. `grads_in_host`:
    gradients that wait for an NVMe optimizer's step are held in host memory (`grads_wait_in_host`)."""
    world, p = placement.world_size, placement
    moments = moment_format(p.moments)
    pad = {Tier.DEVICE: lambda n: n, Tier.HOST: _round_up, Tier.NVME: _round_up}
    # on NVMe a gradient slot exists only where gradients must wait there for the step
    nvme_grads = not p.step_in_backward or grad_accumulation > 1
    total = dict.fromkeys(Tier, 0)
    for uses in _all_uses(plan):
        for _, group, run in flat_groups(uses, group_of, sub_group_elems):
            shard = FlatParam.shard_elems(sum(p.numel() for _, p, _ in run), world)
            param_elems = shard * world if p.params_resident else shard  # resident: the whole (padded) flat
            total[p.param_home] += pad[p.param_home](param_elems * p.compute_dtype.itemsize)
            if group is None:
                continue
            home, round_up = p.optim_home, pad[p.optim_home]
            if not p.master_is_param:
                total[home] += round_up(4 * shard)
            total[home] += round_up(moments.state_bytes(shard))
            if home is Tier.NVME and nvme_grads and grads_in_host:
                total[Tier.HOST] += p.grad_dtype.itemsize * shard  # a plain tensor while it waits
            elif home is not Tier.NVME or nvme_grads:
                total[home] += round_up(p.grad_dtype.itemsize * shard)
    return total


def check_host_budget(z: ZeroConfig, homes: dict[Tier, int]) -> None:
    """An explicit host budget must at least hold the shards that live in host memory."""
    budget = z.host_budget_bytes
    if budget is not None and homes[Tier.HOST] > budget:
        raise ConfigError(
            f"'zero_optimization.host_budget_bytes' is {budget}; the shards that live in host memory "
            f"(offload_param / offload_optimizer 'cpu') need {homes[Tier.HOST]} bytes: raise the budget to at "
            "least that, or offload them to 'nvme'"
        )
