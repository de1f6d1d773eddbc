"""Each pipeline's declared memory bound holds: its high-water mark, measured with no budget to cap it.

The memory plan sums these bounds into the tier budgets (`engine.memory_plan`); if a pipeline held
more than it declares, a budgeted run would wait or fail where the plan said it fits.
"""

from __future__ import annotations

import pytest
import torch
from harness import config
from torch import nn
from toy_models import SEQ, batches, make_model

import infinity
from infinity.comm import CommGroup
from infinity.config import AioConfig, load_config, resolve_auto, resolve_batch_sizes
from infinity.models.gpt import GPT, gpt_preset
from infinity.optim.sharded_adam import ShardedAdam
from infinity.optim.steppers import NativeStepper
from infinity.partition import FlatParam
from infinity.scheduler import BlockScheduler
from infinity.shards import ShardKind, ShardStore, resolve_placement
from infinity.storage import Tier, TierBudgets, TierStore

pytestmark = pytest.mark.unit

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1


def _placement(clip: float):
    cfg = config(
        micro_bs=1, persistence=64, offload_param="nvme", offload_optimizer="nvme", clip=clip, nvme_path="/unused"
    )
    cfg = resolve_auto(resolve_batch_sizes(load_config(cfg), 1), 64)
    return resolve_placement(cfg, torch.device("cpu"), 1, client_optimizer=False)


def _flats(store: ShardStore, sizes: list[int]) -> list[FlatParam]:
    comm = CommGroup(0, 1)
    flats = []
    for i, n in enumerate(sizes):
        owner = nn.Module()
        owner.weight = nn.Parameter(torch.randn(n))
        flat = FlatParam(
            f"b{i}#0",
            [(f"b{i}.weight", owner.weight, ((owner, "weight"),))],
            torch.float32,
            torch.device("cpu"),
            comm,
            0,
            False,
        )
        full32 = flat.initial_full_fp32()
        flat.install_views()
        store.add(flat, full32)
        flat.reshard()
        flats.append(flat)
    return flats


def _optimizer(tmp_path, clip: float, window: int, sizes: list[int]):
    tiers = TierStore(str(tmp_path), AioConfig(), TierBudgets())  # no budget: the pipeline's own bound only
    store = ShardStore(tiers, _placement(clip), CommGroup(0, 1), grad_writes_in_flight=max(1, window // 2))
    flats = _flats(store, sizes)
    hyper = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}
    return tiers, store, flats, ShardedAdam([hyper], True, store, window)


def _torch_reference(master: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    p = nn.Parameter(master.clone())
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    p.grad = grad.clone()
    opt.step()
    return p.detach()


@pytest.mark.parametrize("window", [1, 2, 4])
def test_the_native_stepper_streaming_from_nvme_holds_at_most_its_window(tmp_path, window):
    sizes = [5000, 9000, 3000, 9000, 7000, 2000, 9000]
    tiers, store, flats, optimizer = _optimizer(tmp_path, clip=1.0, window=window, sizes=sizes)
    grads = {f: torch.randn(f.shard_numel) for f in flats}
    before = {f: store.read(f, ShardKind.MASTER) for f in flats}
    for f in flats:
        optimizer.accumulate_grad(f, grads[f], final=True)
    store.finish_grad_writes()
    tiers.reset_high_water(Tier.HOST)
    optimizer.step()
    largest = max(f.shard_numel for f in flats)
    assert 0 < tiers.high_water_bytes(Tier.HOST) <= NativeStepper.host_bytes(window, largest)
    for f in flats:  # and it stepped every shard as torch's AdamW would
        torch.testing.assert_close(store.read(f, ShardKind.MASTER), _torch_reference(before[f], grads[f]))
    tiers.close()


@pytest.mark.parametrize("window", [2, 4])
def test_the_native_stepper_stepping_as_gradients_arrive_holds_at_most_its_window(tmp_path, window):
    sizes = [6000, 9000, 4000, 9000, 8000]
    tiers, store, flats, optimizer = _optimizer(tmp_path, clip=0.0, window=window, sizes=sizes)
    assert store.placement.step_in_backward
    before = {f: store.read(f, ShardKind.MASTER) for f in flats}
    grads = {f: torch.randn(f.shard_numel) for f in flats}
    tiers.reset_high_water(Tier.HOST)
    for f in flats:
        optimizer.accumulate_grad(f, grads[f], final=True)  # arrivals: stepped a few shards later
    assert optimizer.stepped_in_backward == len(flats) - max(1, window // 2)
    optimizer.step()
    largest = max(f.shard_numel for f in flats)
    assert 0 < tiers.high_water_bytes(Tier.HOST) <= NativeStepper.host_bytes(window, largest)
    for f in flats:
        torch.testing.assert_close(store.read(f, ShardKind.MASTER), _torch_reference(before[f], grads[f]))
    tiers.close()


def test_gradient_accumulation_on_nvme_holds_one_shard_in_host_memory(tmp_path):
    tiers, store, flats, optimizer = _optimizer(tmp_path, clip=1.0, window=4, sizes=[9000, 3000])
    parts = [torch.randn(f.shard_numel) for f in flats for _ in range(3)]
    for i, f in enumerate(flats):
        optimizer.accumulate_grad(f, parts[3 * i], final=False)
    store.finish_grad_writes()
    tiers.reset_high_water(Tier.HOST)
    for i, f in enumerate(flats):
        optimizer.accumulate_grad(f, parts[3 * i + 1], final=False)
        optimizer.accumulate_grad(f, parts[3 * i + 2], final=True)
    largest = max(f.shard_numel for f in flats)
    assert 0 < tiers.high_water_bytes(Tier.HOST) <= ShardStore.grad_accumulation_bytes(largest)
    for i, f in enumerate(flats):  # the sum, and the norm the clipping will read
        total = parts[3 * i] + parts[3 * i + 1] + parts[3 * i + 2]
        torch.testing.assert_close(store.read(f, ShardKind.GRAD), total)
        assert store.records[f].grad_norm_sq == pytest.approx(float(total.norm()) ** 2, rel=1e-5)
    tiers.close()


def test_parameter_read_ahead_stays_within_its_cap(tmp_path):
    tiers = TierStore(str(tmp_path), AioConfig(), TierBudgets())
    cap = 3 * 8192 * 4
    store = ShardStore(tiers, _placement(1.0), CommGroup(0, 1), read_ahead_bytes=cap)
    flats = _flats(store, [8000] * 8)
    tiers.reset_high_water(Tier.HOST)
    store.read_ahead(flats)
    for f in flats[:3]:  # what fits is on its way; what does not was never asked for
        assert tiers.tiers_holding(store.key(f, ShardKind.PARAM)) in (["nvme"], ["host", "nvme"])
    handles = [store.fetch_param(f) for f in flats[:3]]
    for h in handles:
        h.wait()
    assert 0 < tiers.high_water_bytes(Tier.HOST) <= cap
    for f in flats[:3]:
        store.release_param(f)
    tiers.close()


@pytest.mark.parametrize("bucket_blocks", [0, 1, 3])
def test_the_scheduler_holds_at_most_its_declared_gathered_weights(tmp_path, bucket_blocks):
    cfg = config(micro_bs=1, persistence=64, offload_param="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    full_block = max(b.numel for b in engine.blocks)
    bucket = bucket_blocks * full_block
    engine.scheduler.prefetch_bucket_elems = bucket
    data = batches("gpt", 1)
    for _ in range(3):
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    bound = BlockScheduler.gathered_bytes_bound(full_block, bucket, engine.compute_dtype.itemsize)
    assert engine.scheduler.prefetches_issued > 0 or bucket == 0
    assert 0 < engine.scheduler.gathered_high_water_bytes <= bound
    engine.close()


@pytest.mark.parametrize("bucket_blocks", [2, 3])
def test_the_scheduler_holds_at_most_its_declared_gathered_weights_with_more_blocks_than_the_bucket(
    tmp_path, bucket_blocks
):
    """Eight blocks, a bucket of two or three: what earlier prefetches left in flight counts against it."""
    cfg = config(micro_bs=1, persistence=64, offload_param="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path))
    torch.manual_seed(0)
    model = GPT(gpt_preset("tiny", bias=False, block_size=SEQ, n_layer=8))
    engine, _, _, _ = infinity.initialize(model=model, config=cfg)
    full_block = max(b.numel for b in engine.blocks)
    bucket = bucket_blocks * full_block
    engine.scheduler.prefetch_bucket_elems = bucket
    data = batches("gpt", 1)
    for _ in range(3):
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    bound = BlockScheduler.gathered_bytes_bound(full_block, bucket, engine.compute_dtype.itemsize)
    assert engine.scheduler.prefetches_issued > 0
    assert 0 < engine.scheduler.gathered_high_water_bytes <= bound
    engine.close()


@pytest.mark.parametrize(
    "dtype,clip,grad_accum,moments", [("fp32", 1.0, 1, "fp32"), ("bf16", 0.0, 1, "8bit"), ("fp32", 0.0, 2, "bf16")]
)
def test_the_swap_file_is_sized_to_exactly_what_the_run_writes(tmp_path, dtype, clip, grad_accum, moments):
    """The plan's NVMe figure is the run's high-water mark, and the swap file is that plus its header: a
    small model fits a small disk (issue 12), and the up-front free-space check asks for the right amount."""
    import os

    from infinity.storage import swap_file_bytes

    cfg = config(
        micro_bs=1,
        grad_accum=grad_accum,
        persistence=64,
        offload_param="nvme",
        offload_optimizer="nvme",
        dtype=dtype,
        clip=clip,
        nvme_path=str(tmp_path),
    )
    cfg["zero_optimization"]["offload_optimizer"]["moments"] = moments
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    planned = engine.tiers.stats()["nvme"]["high_water_bytes"]  # before training: the first puts only
    data = batches("gpt", 1)
    for _ in range(2 * grad_accum):
        x, y = next(data)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    high_water = engine.tiers.high_water_bytes(Tier.NVME)
    assert planned <= high_water == engine.nvme_bytes_planned
    assert os.path.getsize(engine.tiers.swap_path) == swap_file_bytes(engine.nvme_bytes_planned)
    engine.close()
