"""Every setting the diagnosis names changes something: the shards' tiers and budget plan
(`engine.memory_plan.plan_memory` on a GPU's placement, for a model whose blocks are the synthetic scenarios' 64 MB bf16
shards) or the run (what the engine prefetches; the aio section the store's engine is built from).
No key that changes nothing is named."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
from harness import config as harness_config
from test_profiler_diagnosis import _diagnose, _optimizer_stall_trace
from torch import nn
from toy_models import batches, make_model

import infinity
from infinity.config import load_config
from infinity.engine.memory_plan import MemoryPlan
from infinity.partition import plan_blocks
from infinity.profiler.knob_effects import prefetch_change, read_ahead_change
from infinity.profiler.synthetic import SCENARIOS, config_for
from infinity.tuning.effects import budget_plan

Z = "zero_optimization."
TIERS = {"none": "device", "cpu": "host", "nvme": "nvme"}
SHARD_BYTES = 64_000_000  # the scenarios' blocks: 32e6 bf16 elements at one rank


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(8000, 4000, bias=False)  # 32e6 elements


def _budget_plan(config: dict) -> tuple[str, str, MemoryPlan]:
    """Where the engine puts parameter and optimizer shards, and the budget plan it makes for them."""
    cfg = load_config(config)
    z = cfg.zero_optimization
    with torch.device("meta"):
        model = nn.Sequential(*[Block() for _ in range(16)])
    plan = plan_blocks(model, ("Block",), z.block_size_elems, z.stage3_param_persistence_threshold)
    tiers = TIERS[z.offload_param.device], TIERS[z.offload_optimizer.device]
    return *tiers, budget_plan(cfg, plan, torch.device("cuda", 0))


def _set(config: dict, key: str, value) -> dict:
    out = copy.deepcopy(config)
    *sections, last = key.split(".")
    node = out
    for name in sections:
        node = node.setdefault(name, {})
    node[last] = value
    return out


def _applied(config: dict, r) -> dict:
    out = _set(config, r.setting, r.value)
    for key, value in r.also:
        out = _set(out, key, value)
    return out


def _cases(tmp_path: Path):
    """(config, diagnosis) of every scenario and of variants that make other keys the effective ones."""
    for name, scenario in SCENARIOS.items():
        yield config_for(scenario), _diagnose(tmp_path / name, scenario, ranks=2 if name == "gather_bound" else 1)
    variants = {
        "budget": dataclasses.replace(SCENARIOS["disk_bound"], host_budget_bytes=2_000_000_000),
        "pool": dataclasses.replace(SCENARIOS["tuned"], pool_exhausted_per_step=1),
        "deep_queue": dataclasses.replace(SCENARIOS["slow_disk"], queue_depth=64),
    }
    for name, scenario in variants.items():
        yield config_for(scenario), _diagnose(tmp_path / name, scenario)
    for name, scenario in {"window": SCENARIOS["tuned"], "window_budget": variants["budget"]}.items():
        yield config_for(scenario), _optimizer_stall_trace(tmp_path / name, scenario)


def test_every_recommendation_changes_the_budget_plan_or_the_run(tmp_path: Path) -> None:
    named = set()
    for config, d in _cases(tmp_path):
        for r in d.recommendations:
            named.add(r.setting)
            after = _applied(config, r)
            if r.setting.startswith("aio."):  # the store's I/O engine is built from this section
                assert load_config(after).aio != load_config(config).aio, r
            elif r.setting == Z + "stage3_prefetch_bucket_size":  # held to the run below
                assert r.value > r.current, r
            else:
                assert _budget_plan(after) != _budget_plan(config), r
    assert named == {
        Z + "offload_param.buffer_count",
        Z + "offload_optimizer.buffer_count",
        Z + "host_budget_bytes",
        Z + "stage3_prefetch_bucket_size",
        "aio.queue_depth",
        "aio.intra_op_parallelism",
    }


@pytest.mark.parametrize(
    ("optimizer", "host_budget", "count", "size", "max_in_cpu"),
    list(itertools.product(("nvme", "cpu", "none"), (None, 3_000_000_000), (1, 5), (10_000_000, 100_000_000),
                           (0, 50_000_000, 1_000_000_000))),  # fmt: skip
)
def test_keeping_more_parameters_in_host_memory_names_the_key_that_sizes_it(
    optimizer: str, host_budget: int | None, count: int, size: int, max_in_cpu: int
) -> None:
    config = config_for(dataclasses.replace(SCENARIOS["tuned"], host_budget_bytes=host_budget))
    z = config["zero_optimization"]
    z["offload_optimizer"]["device"] = optimizer
    z["offload_param"].update(buffer_count=count, buffer_size=size, max_in_cpu=max_in_cpu)
    change = read_ahead_change(config, SHARD_BYTES)
    after = _set(config, change.setting, change.value)
    for key, value in change.also:
        after = _set(after, key, value)
    assert _budget_plan(after) != _budget_plan(config), change


# -- the prefetch bucket, held to what a real engine prefetches ------------------------------------


def _prefetches(tmp_path: Path, param_device: str, bucket: int) -> tuple[int, int]:
    """(prefetches issued in two steps, the largest block's elements) of the tiny GPT at one rank."""
    nvme = tmp_path / "nvme"
    nvme.mkdir(exist_ok=True)
    nvme_path = str(nvme) if param_device == "nvme" else None
    cfg = harness_config(micro_bs=2, persistence=64, offload_param=param_device, nvme_path=nvme_path,
                         extra_zero={"stage3_prefetch_bucket_size": bucket})  # fmt: skip
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    try:
        data = batches("gpt", 2)
        for _ in range(2):
            x, y = next(data)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        return engine.scheduler.prefetches_issued, max(b.numel for b in engine.blocks)
    finally:
        engine.close()


def test_a_larger_prefetch_bucket_prefetches_more_where_blocks_are_gathered(tmp_path: Path) -> None:
    issued, block_elems = _prefetches(tmp_path, "nvme", 0)
    config = {"zero_optimization": {"offload_param": {"device": "nvme"}, "stage3_prefetch_bucket_size": 0}}
    change = prefetch_change(config, world_size=1, block_elems=block_elems)
    more, _ = _prefetches(tmp_path, "nvme", change.value)
    assert (issued, change.value) == (0, 2 * block_elems) and more > 0


def test_one_rank_with_parameters_on_the_device_is_never_told_to_prefetch(tmp_path: Path) -> None:
    config = {"zero_optimization": {"offload_param": {"device": "none"}, "stage3_prefetch_bucket_size": 0}}
    assert prefetch_change(config, world_size=1, block_elems=1000) is None
    assert prefetch_change(config, world_size=2, block_elems=1000) is not None
    none, block_elems = _prefetches(tmp_path, "none", 0)
    assert _prefetches(tmp_path, "none", 4 * block_elems)[0] == none == 0  # blocks stay resident: nothing to do


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_1_and_2_are_never_told_to_prefetch(stage: int) -> None:
    """Every rank holds the whole parameters there (`test_zero_stages`: no block is ever prefetched)."""
    config = {"zero_optimization": {"stage": stage, "stage3_prefetch_bucket_size": 0}}
    assert prefetch_change(config, world_size=2, block_elems=1000) is None
