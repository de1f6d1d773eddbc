"""The memory plan: host budgets summed from the bounds each pipeline declares for itself.

Every expected figure is computed from the pipelines' own bound functions (`NativeStepper.host_bytes` and
`shard_state_bytes`, `BlockScheduler.working_set_bytes`, `ShardStore.gather_host_bytes` and
`grad_accumulation_bytes`), so the plan is held to what the pipelines say they spend, not to a copy of its
own arithmetic. The model is the toy mlp: blocks of 408, 600 and 600 elements, the head (200) in the root.
"""

from __future__ import annotations

import pytest
from harness import config, placement_of, resolved
from toy_models import make_model

from infinity.config import ConfigError
from infinity.engine.memory_plan import (
    MemoryPlan,
    largest_flat_shard_elems,
    largest_shard_elems,
    plan_memory,
    spare_host_bytes,
    trainable_flats,
)
from infinity.optim.steppers import NativeStepper
from infinity.partition import plan_blocks
from infinity.partition.flat_param import SHARD_ALIGN_ELEMS
from infinity.scheduler import BlockScheduler
from infinity.shards.store import ShardStore

pytestmark = pytest.mark.unit

FP32 = 4
BUCKET = 3000  # stage3_prefetch_bucket_size: elements
WINDOW = 4  # offload_optimizer.buffer_count
HUGE = 1 << 40
Z = "zero_optimization."


def _cfg(param: str, optim: str, host_budget: int | None = None, device_budget: int | None = None, **offload) -> dict:
    cfg = config("mlp", offload_param=param, offload_optimizer=optim, nvme_path="/unused")
    z = cfg["zero_optimization"]
    z.update(host_budget_bytes=host_budget, device_budget_bytes=device_budget, stage3_prefetch_bucket_size=BUCKET)
    z["offload_optimizer"]["buffer_count"] = WINDOW
    z["offload_param"].update(offload)
    return cfg


def _plan(cfg: dict, world: int = 1) -> MemoryPlan:
    model = make_model("mlp")
    blocks = plan_blocks(model, ("MLPLayer",), block_size_elems=1, persistence_threshold=0)
    return plan_memory(resolved(cfg, world).zero_optimization, blocks, placement_of(cfg, world))


def _largest(world: int = 1) -> tuple[int, int, int]:
    blocks = plan_blocks(make_model("mlp"), ("MLPLayer",), block_size_elems=1, persistence_threshold=0)
    return largest_shard_elems(blocks, world)


def _bucket() -> int:
    """The prefetch bucket the plan counts: BUCKET, but no more than the blocks hold (root and persistent apart)."""
    _, total, always_gathered = _largest()
    return min(BUCKET, total - always_gathered)


def _optim(world: int = 1, sub_group_elems: int = 10**9) -> int:
    """The optimizer's unit: the largest flat's shard (flats are sub-groups of `sub_group_size` at most)."""
    blocks = plan_blocks(make_model("mlp"), ("MLPLayer",), block_size_elems=1, persistence_threshold=0)
    return largest_flat_shard_elems(blocks, {}, world, sub_group_elems)


@pytest.mark.parametrize("world,largest", [(1, 600 + SHARD_ALIGN_ELEMS), (2, 300 + SHARD_ALIGN_ELEMS)])
def test_the_largest_shard_allows_for_padding_and_the_root_is_gathered_all_pass(world, largest):
    assert _largest(world) == (largest, 408 + 600 + 600 + 200, 200)


# -- no explicit host budget: the sum of what the pipelines declare -----------------------------------------


def test_nvme_everything_without_a_host_budget_is_bounded_by_the_pipelines_declared_needs():
    largest, _, _ = _largest()
    plan = _plan(_cfg("nvme", "nvme", buffer_count=5, buffer_size=100_000))
    read_ahead = 5 * 100_000 * FP32  # offload_param.buffer_count x buffer_size
    assert plan.param_read_ahead_bytes == read_ahead
    assert plan.optimizer_window == WINDOW
    stepper = NativeStepper.host_bytes(WINDOW, _optim())
    assert plan.budgets.host_bytes == read_ahead + ShardStore.grad_accumulation_bytes(_optim()) + stepper


def test_read_ahead_holds_at_least_four_of_the_largest_shards():
    largest, _, _ = _largest()
    plan = _plan(_cfg("nvme", "nvme", buffer_count=1, buffer_size=10))
    assert plan.param_read_ahead_bytes == 4 * largest * FP32


@pytest.mark.parametrize("max_in_cpu,elems", [(0, None), (200_000, 200_000), (10**9, 5 * 100_000)])
def test_max_in_cpu_caps_the_read_ahead_and_zero_keeps_the_least(max_in_cpu, elems):
    largest, _, _ = _largest()
    plan = _plan(_cfg("nvme", "nvme", buffer_count=5, buffer_size=100_000, max_in_cpu=max_in_cpu))
    assert plan.param_read_ahead_bytes == (4 * largest if elems is None else elems) * FP32


def test_parameters_alone_on_nvme_budget_only_their_read_ahead():
    plan = _plan(_cfg("nvme", "none", buffer_count=5, buffer_size=100_000))
    assert plan.budgets.host_bytes == plan.param_read_ahead_bytes == 5 * 100_000 * FP32


def test_the_optimizer_alone_on_nvme_budgets_its_window_and_the_gradient_accumulation():
    largest, _, _ = _largest()
    plan = _plan(_cfg("none", "nvme"))
    assert plan.param_read_ahead_bytes is None
    expected = NativeStepper.host_bytes(WINDOW, _optim()) + ShardStore.grad_accumulation_bytes(_optim())
    assert plan.budgets.host_bytes == expected


@pytest.mark.parametrize("param,optim", [("cpu", "cpu"), ("nvme", "cpu"), ("cpu", "nvme"), ("none", "none")])
def test_host_memory_is_unbounded_where_shards_live_there_or_nothing_is_on_nvme(param, optim):
    plan = _plan(_cfg(param, optim))
    assert plan.budgets.host_bytes is None and plan.param_read_ahead_bytes is None
    assert plan.optimizer_window == WINDOW


def test_the_device_budget_passes_through():
    assert _plan(_cfg("nvme", "nvme", device_budget=12345)).budgets.device_bytes == 12345


def test_without_an_explicit_budget_the_computes_working_set_is_not_counted():
    in_host = _plan(_cfg("nvme", "nvme"))  # a CPU-only machine: the compute reads host memory
    on_device = _plan(_cfg("nvme", "nvme", device_budget=HUGE))  # a device pool of its own
    assert placement_of(_cfg("nvme", "nvme")).compute_in_host_memory
    assert in_host.budgets.host_bytes == on_device.budgets.host_bytes


# -- an explicit host budget: the optimizer's window shrinks to fit, read-ahead gets the rest ----------------


def _fixed_needs(largest: int, optim: int, held: int = 0) -> int:
    """Host bytes the NVMe pipelines need whatever the window: a gather's shards and the gradient sum."""
    return ShardStore.gather_host_bytes(largest, held, FP32) + ShardStore.grad_accumulation_bytes(optim)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("shards_that_fit", [1, 2, 3])
def test_the_optimizer_window_shrinks_to_what_the_budget_leaves(world, shards_that_fit):
    largest, _, _ = _largest(world)
    optim = _optim(world)
    state = NativeStepper.shard_state_bytes(optim)
    budget = _fixed_needs(largest, optim) + shards_that_fit * state + state // 2
    plan = _plan(_cfg("nvme", "nvme", host_budget=budget, device_budget=HUGE), world)
    assert plan.optimizer_window == shards_that_fit
    assert plan.budgets.host_bytes == budget
    assert plan.param_read_ahead_bytes == budget - ShardStore.grad_accumulation_bytes(optim) - shards_that_fit * state
    assert plan.param_read_ahead_bytes >= ShardStore.gather_host_bytes(largest, 0, FP32)  # a gather still fits


def test_a_large_budget_keeps_the_configured_window_and_gives_the_rest_to_read_ahead():
    plan = _plan(_cfg("nvme", "nvme", host_budget=HUGE, device_budget=HUGE))
    state = NativeStepper.shard_state_bytes(_optim())
    assert plan.optimizer_window == WINDOW
    assert plan.param_read_ahead_bytes == HUGE - ShardStore.grad_accumulation_bytes(_optim()) - WINDOW * state


def test_with_the_compute_in_host_memory_an_explicit_budget_also_covers_its_working_set():
    largest, _, always_gathered = _largest()
    in_host = _plan(_cfg("nvme", "nvme", host_budget=HUGE))
    on_device = _plan(_cfg("nvme", "nvme", host_budget=HUGE, device_budget=HUGE))
    working = BlockScheduler.working_set_bytes(largest, _bucket(), FP32, WINDOW) + always_gathered * FP32
    assert on_device.param_read_ahead_bytes - in_host.param_read_ahead_bytes == working
    assert in_host.budgets.host_bytes == HUGE - working  # what the tier store may hold beside the compute


# -- too small: an error naming the key and the bytes needed ------------------------------------------------


def test_a_budget_below_one_optimizer_shard_is_refused_with_the_bytes_needed():
    largest, _, _ = _largest()
    need = _fixed_needs(largest, _optim()) + NativeStepper.shard_state_bytes(_optim())
    assert _plan(_cfg("nvme", "nvme", host_budget=need, device_budget=HUGE)).optimizer_window == 1
    key = "'zero_optimization.host_budget_bytes'"
    with pytest.raises(ConfigError, match=rf"{key} is {need - 1};.*at least {need} bytes"):
        _plan(_cfg("nvme", "nvme", host_budget=need - 1, device_budget=HUGE))


def test_with_the_compute_in_host_memory_the_bytes_needed_include_its_working_set_and_held_shards():
    largest, total, always_gathered = _largest()
    held = min(BUCKET, total)  # one rank: the prefetch bucket's shards, held from their fetch to their gather
    working = BlockScheduler.working_set_bytes(largest, _bucket(), FP32, WINDOW) + always_gathered * FP32
    need = working + _fixed_needs(largest, _optim(), held) + NativeStepper.shard_state_bytes(_optim())
    assert _plan(_cfg("nvme", "nvme", host_budget=need)).optimizer_window == 1
    with pytest.raises(ConfigError, match=rf"is {need - 1};.*needs at least {need} bytes.*raise the budget"):
        _plan(_cfg("nvme", "nvme", host_budget=need - 1))


def test_a_prefetch_bucket_larger_than_the_blocks_counts_only_what_they_hold():
    """DeepSpeed configs often carry stage3_prefetch_bucket_size 5e8: on a small model the bucket cannot gather
    more than all its blocks, so a budget that holds them fits (it was refused, asking for 2 GB); a budget
    below it names the bucket among what to lower."""
    largest, total, always_gathered = _largest()
    blocks = total - always_gathered
    exact = _cfg("nvme", "nvme", host_budget=HUGE)
    exact["zero_optimization"]["stage3_prefetch_bucket_size"] = blocks
    huge = _cfg("nvme", "nvme", host_budget=HUGE)
    huge["zero_optimization"]["stage3_prefetch_bucket_size"] = int(5e8)
    assert _plan(huge) == _plan(exact)
    working = BlockScheduler.working_set_bytes(largest, blocks, FP32, WINDOW) + always_gathered * FP32
    assert _plan(huge).budgets.host_bytes == HUGE - working
    huge["zero_optimization"]["host_budget_bytes"] = working
    ahead = max(largest, blocks) * FP32
    named = rf"needs at least .*, {ahead} of them for the weights gathered ahead: .*lower '{Z}stage3_prefetch_bucket"
    with pytest.raises(ConfigError, match=named):
        _plan(huge)


def test_with_the_optimizer_in_memory_its_buffer_count_changes_nothing_in_the_plan():
    """Gradients wait in the native stepper's window on NVMe only; with the optimizer's state in memory the key
    is idle, as its notice at start says (`config/notices.py`)."""
    plans = []
    for count in (1, 16):
        cfg = _cfg("nvme", "none", host_budget=HUGE)
        cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = count
        plans.append(_plan(cfg))
    same = ("budgets", "param_read_ahead_bytes", "freed_block_bytes")  # the window is torch's Adam's: unused
    assert [getattr(plans[0], f) for f in same] == [getattr(plans[1], f) for f in same]
    largest, _, always_gathered = _largest()
    working = BlockScheduler.working_set_bytes(largest, _bucket(), FP32, 0) + always_gathered * FP32
    assert plans[0].budgets.host_bytes == HUGE - working


def test_parameters_alone_on_nvme_need_room_for_one_gather():
    largest, _, _ = _largest()
    need = ShardStore.gather_host_bytes(largest, 0, FP32)
    assert _plan(_cfg("nvme", "none", host_budget=need, device_budget=HUGE)).param_read_ahead_bytes == need
    with pytest.raises(ConfigError, match=rf"at least {need} bytes"):
        _plan(_cfg("nvme", "none", host_budget=need - 1, device_budget=HUGE))


def test_sub_group_size_makes_the_optimizer_stream_smaller_pieces():
    """`sub_group_size` splits each block's flats at parameter boundaries: the optimizer's unit, and so its
    window's host memory, shrinks (the tiny GPT's blocks of ~12k elements, in pieces of at most 4096)."""
    cfg = config("gpt", offload_optimizer="nvme", nvme_path="/unused")
    gpt = plan_blocks(make_model("gpt"), ("Block",), block_size_elems=1, persistence_threshold=0)
    whole, pieces = (largest_flat_shard_elems(gpt, {}, 1, n) for n in (10**9, 4096))
    assert pieces < whole
    plans = []
    for sub_group in (10**9, 4096):
        cfg["zero_optimization"]["sub_group_size"] = sub_group
        plans.append(plan_memory(resolved(cfg).zero_optimization, gpt, placement_of(cfg)))
    for plan, unit in zip(plans, (whole, pieces), strict=True):
        expected = NativeStepper.host_bytes(4, unit) + ShardStore.grad_accumulation_bytes(unit)
        assert plan.budgets.host_bytes == expected
    assert plans[1].budgets.host_bytes < plans[0].budgets.host_bytes


# -- a step deferred into the next forward (clipping), no host budget: its window grows into spare memory ---


def _deferred(spare: int, clip: float = 1.0, host_budget: int | None = None, buffer_count: int = 1) -> MemoryPlan:
    cfg = _cfg("nvme", "nvme", host_budget)
    cfg["gradient_clipping"] = clip
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = buffer_count
    model = make_model("mlp")
    blocks = plan_blocks(model, ("MLPLayer",), block_size_elems=1, persistence_threshold=0)
    group_of = {id(p): 0 for p in model.parameters()}  # one param group, every parameter trainable
    return plan_memory(resolved(cfg).zero_optimization, blocks, placement_of(cfg), group_of, spare_host_bytes=spare)


def test_the_toy_has_a_trainable_flat_per_block_and_one_for_the_root():
    model = make_model("mlp")
    blocks = plan_blocks(model, ("MLPLayer",), block_size_elems=1, persistence_threshold=0)
    assert trainable_flats(blocks, {id(p): 0 for p in model.parameters()}, 10**9) == len(blocks.blocks) + 1 == 4
    assert trainable_flats(blocks, {}, 10**9) == 0  # no parameter in a group: nothing for the optimizer


@pytest.mark.parametrize("shards_that_fit,window", [(0, 1), (2, 1), (3, 2), (4, 3), (5, 4), (50, 4)])
def test_a_deferred_steps_window_grows_as_far_as_the_spare_memory_holds_shards_up_to_every_flat(
    shards_that_fit, window
):
    state = NativeStepper.shard_state_bytes(_optim())
    plan = _deferred(spare=shards_that_fit * state + state - 1)  # host_bytes(w) holds w + 1 shards' state
    assert plan.optimizer_window == window
    read_ahead = _plan(_cfg("nvme", "nvme")).param_read_ahead_bytes
    rmw = ShardStore.grad_accumulation_bytes(_optim())
    assert plan.budgets.host_bytes == read_ahead + rmw + NativeStepper.host_bytes(window, _optim())


def test_the_window_keeps_buffer_count_where_the_step_runs_in_backward_or_a_budget_is_set():
    assert _deferred(spare=HUGE, clip=0.0).optimizer_window == 1  # no clipping: stepped as gradients arrive
    assert _deferred(spare=HUGE, host_budget=HUGE).optimizer_window == 1  # the budget sizes it (from buffer_count)
    assert _deferred(spare=HUGE, buffer_count=6).optimizer_window == 6  # never below buffer_count


def test_spare_host_memory_is_a_quarter_of_what_is_available_per_local_rank_less_held_gradients(monkeypatch):
    cfg = _cfg("nvme", "nvme")
    z, placement = resolved(cfg).zero_optimization, placement_of(cfg)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert spare_host_bytes(z, placement, 0, available=16 << 30) == 2 << 30
    assert spare_host_bytes(z, placement, 1 << 30, available=16 << 30) == 1 << 30
    assert spare_host_bytes(z, placement, 3 << 30, available=16 << 30) == 0
    budgeted = _cfg("nvme", "nvme", host_budget=HUGE)
    assert spare_host_bytes(resolved(budgeted).zero_optimization, placement_of(budgeted), 0, available=16 << 30) == 0
    on_cpu = _cfg("nvme", "cpu")
    assert spare_host_bytes(resolved(on_cpu).zero_optimization, placement_of(on_cpu), 0, available=16 << 30) == 0
