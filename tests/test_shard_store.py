"""ShardStore's verbs on their own, over a real TierStore (NVMe homes in a direct-I/O file under a temp dir).

Placements come from the policy (`resolve_placement`) for a config; a world of two is this process as rank
1 of two (no collective is called: the store keeps only its own rank's range).
"""

from __future__ import annotations

import pytest
import torch
from harness import config, placement_of
from torch import nn

from infinity.comm import CommGroup
from infinity.config import AioConfig
from infinity.optim.cpu_adam import adam_step_flat
from infinity.partition import FlatParam
from infinity.shards import ShardKind, ShardStore
from infinity.shards.registry import owner_of
from infinity.storage import Tier, TierBudgets, TierStore
from infinity.storage.buffer_pool import round_up
from infinity.storage.recorder import MoveCounter

pytestmark = pytest.mark.unit
pytest_plugins = ["storage_fixtures"]  # disk_dir: a directory on a disk that takes O_DIRECT

NUMEL = 3000
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (world, offload_param, offload_optimizer, dtype): one rank resident or not, homes in memory or on NVMe,
# the master the parameter shard itself (fp32, one memory) or a shard of its own
PLACEMENTS = [
    (1, "none", "none", "fp32"),  # resident, master is the parameter shard
    (1, "cpu", "cpu", "bf16"),  # resident, master apart
    (2, "cpu", "cpu", "fp32"),  # not resident, master is the parameter shard
    (2, "none", "nvme", "bf16"),
    (1, "nvme", "cpu", "fp32"),
    (2, "cpu", "nvme", "fp32"),
    (1, "nvme", "nvme", "fp32"),
    (2, "nvme", "nvme", "bf16"),
]


def _store(directory, world: int, param: str, optim: str, dtype: str, clip: float = 1.0) -> ShardStore:
    cfg = config("mlp", offload_param=param, offload_optimizer=optim, dtype=dtype, clip=clip, nvme_path=str(directory))
    placement = placement_of(cfg, world)
    return ShardStore(TierStore(str(directory), AioConfig(), TierBudgets()), placement, CommGroup(world - 1, world))


def _add(store: ShardStore, name: str = "b#0", trainable: bool = True) -> tuple[FlatParam, torch.Tensor]:
    """A flat of one NUMEL-element parameter handed to `store`, as `shard_model` does; (it, its fp32 values)."""
    owner = nn.Module()
    owner.weight = nn.Parameter(torch.randn(NUMEL))
    placement = store.placement
    flat = FlatParam(
        name,
        [(f"{name}.weight", owner.weight, ((owner, "weight"),))],
        placement.compute_dtype,
        placement.compute_device,
        store.comm,
        0 if trainable else None,
        persistent=False,
    )
    full32 = torch.zeros(flat.padded_numel)
    full32[:NUMEL] = owner.weight.detach()
    flat.install_views()
    store.add(flat, full32)
    if not flat.resident:
        flat.reshard()
    return flat, full32


def _shard(flat: FlatParam, full: torch.Tensor) -> torch.Tensor:
    start, end = flat.shard_range
    return full[start:end]


def _read_from_home(store: ShardStore, flat: FlatParam, kind: ShardKind) -> torch.Tensor:
    """`read`, with cached copies above the home dropped first: an NVMe home is read from the file."""
    store.tiers.evict(store.key(flat, kind))
    return store.read(flat, kind)


def _moments_from_home(store: ShardStore, flat: FlatParam) -> dict[str, torch.Tensor]:
    """`read_moments` (fp32 moments here), from the home likewise."""
    store.tiers.evict(store.key(flat, ShardKind.MOMENTS))
    return store.read_moments(flat)


@pytest.mark.parametrize("world,param,optim,dtype", PLACEMENTS)
def test_add_keeps_this_ranks_shard_of_the_initial_weights_and_zero_moments(disk_dir, world, param, optim, dtype):
    store = _store(disk_dir, world, param, optim, dtype)
    flat, full32 = _add(store)
    assert flat.resident == store.placement.params_resident
    mine = _shard(flat, full32)
    assert torch.equal(_read_from_home(store, flat, ShardKind.MASTER), mine)
    assert torch.equal(_read_from_home(store, flat, ShardKind.PARAM), mine.to(DTYPES[dtype]))
    for moment in _moments_from_home(store, flat).values():
        assert not moment.any()
    store.close()


@pytest.mark.parametrize("world,param,optim,dtype", PLACEMENTS)
def test_assign_then_read_round_trips_every_kind(disk_dir, world, param, optim, dtype):
    store = _store(disk_dir, world, param, optim, dtype)
    flat, _ = _add(store)
    new, m, v = (torch.randn(flat.shard_numel) for _ in range(3))
    store.assign(flat, new, moments=("fp32", {"exp_avg": m, "exp_avg_sq": v.abs()}), step=7)
    assert torch.equal(_read_from_home(store, flat, ShardKind.MASTER), new)
    assert torch.equal(store.read_weights(flat), new)
    assert torch.equal(_read_from_home(store, flat, ShardKind.PARAM), new.to(DTYPES[dtype]))
    moments = _moments_from_home(store, flat)
    assert torch.equal(moments["exp_avg"], m) and torch.equal(moments["exp_avg_sq"], v.abs())
    assert store.records[flat].step == 7
    if flat.resident:  # the parameters are views of the shard: they see the new weights at once
        assert torch.equal(_shard(flat, flat.full), new.to(DTYPES[dtype]))
    store.close()


def test_the_master_and_the_parameter_shard_are_one_key_where_the_policy_says_so(disk_dir):
    for name in ("aliased", "apart"):
        (disk_dir / name).mkdir()
    aliased = _store(disk_dir / "aliased", 1, "cpu", "cpu", "fp32")
    apart = _store(disk_dir / "apart", 1, "cpu", "cpu", "bf16")
    (flat_a, _), (flat_b, _) = _add(aliased), _add(apart)
    assert aliased.placement.master_is_param and not apart.placement.master_is_param
    assert aliased.key(flat_a, ShardKind.MASTER) == aliased.key(flat_a, ShardKind.PARAM)
    assert apart.key(flat_b, ShardKind.MASTER) != apart.key(flat_b, ShardKind.PARAM)
    master = aliased.shard_view(flat_a, ShardKind.MASTER)
    assert master.data_ptr() == flat_a.full.data_ptr()  # one slot: the optimizer steps the parameters
    aliased.close()
    apart.close()


@pytest.mark.parametrize("param", ["cpu", "nvme"])
def test_a_frozen_flat_keeps_only_its_parameter_shard(disk_dir, param):
    store = _store(disk_dir, 2, param, param, "bf16")
    flat, full32 = _add(store, trainable=False)
    assert flat not in store.records
    assert torch.equal(store.read_weights(flat), _shard(flat, full32).to(torch.bfloat16).float())
    new = torch.randn(flat.shard_numel).to(torch.bfloat16)
    store.assign_param(flat, new)
    assert torch.equal(_read_from_home(store, flat, ShardKind.PARAM), new)
    store.close()


@pytest.mark.parametrize("param,optim", [("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")])
def test_gather_full_at_one_rank_is_the_whole_flat_in_fp32_or_the_compute_dtype(disk_dir, param, optim):
    store = _store(disk_dir, 1, param, optim, "bf16")
    flat, _ = _add(store)
    new = torch.randn(flat.shard_numel)
    store.assign(flat, new)
    full = store.gather_full(flat)
    assert full.dtype == torch.float32 and torch.equal(full, new)  # the masters, not their bf16 rounding
    assert torch.equal(store.gather_full(flat, fp32=False), new.to(torch.bfloat16))
    store.close()


# -- lend and give back: one in-place optimizer step ----------------------------------------------------------


def _native_step(lent, fused: bool) -> None:
    """One real native AdamW step on the lent buffers; with `fused` it writes the new weights to param_out."""
    adam_step_flat(lent.master, lent.grad, lent.exp_avg, lent.exp_avg_sq, step=1, lr=1e-2, beta1=0.9, beta2=0.999,
                   eps=1e-8, weight_decay=0.1, out_copy=lent.param_out if fused else None)  # fmt: skip


@pytest.mark.parametrize(
    "world,param,optim,dtype,fused",
    [
        (1, "nvme", "nvme", "bf16", True),  # the native step writes the bf16 weights itself (fused copy-out)
        (2, "nvme", "nvme", "bf16", False),  # the store casts them on give_back
        (2, "none", "nvme", "bf16", True),
        (1, "nvme", "nvme", "fp32", False),  # the master is the parameter shard: one NVMe slot
        (2, "cpu", "nvme", "fp32", False),  # the step's new weights go into the host parameter shard
        (1, "cpu", "cpu", "bf16", True),
        (2, "cpu", "cpu", "fp32", False),  # the master is the parameter shard: nothing to publish
    ],
)
def test_give_back_writes_the_state_home_and_publishes_the_new_weights(disk_dir, world, param, optim, dtype, fused):
    store = _store(disk_dir, world, param, optim, dtype)
    flat, full32 = _add(store)
    # as a run hands it over: a bf16 run's one micro-batch is bf16, and an NVMe slot keeps it so (grad_dtype)
    grad = torch.randn(flat.shard_numel).to(store.placement.grad_dtype)
    store.accumulate_grad(flat, grad, final=True)
    store.finish_grad_writes()
    expected_master = _shard(flat, full32).clone()
    expected_m, expected_v = torch.zeros(flat.shard_numel), torch.zeros(flat.shard_numel)
    adam_step_flat(expected_master, grad.clone(), expected_m, expected_v, step=1, lr=1e-2, beta1=0.9, beta2=0.999,
                   eps=1e-8, weight_decay=0.1)  # fmt: skip
    lent = store.lend(flat, with_grad=True)
    assert torch.equal(lent.grad, grad)
    if fused:
        assert lent.param_out is not None and lent.param_out.dtype == torch.bfloat16
    _native_step(lent, fused)
    store.give_back(lent, param_written=fused).finish()
    if optim == "nvme":  # the host copies lent for the step are gone once it is finished
        assert store.tiers.live_bytes(Tier.HOST) == (flat.shard_numel * 4 if param == "cpu" else 0)
    assert torch.equal(_read_from_home(store, flat, ShardKind.MASTER), expected_master)
    moments = _moments_from_home(store, flat)
    assert torch.equal(moments["exp_avg"], expected_m) and torch.equal(moments["exp_avg_sq"], expected_v)
    assert torch.equal(_read_from_home(store, flat, ShardKind.PARAM), expected_master.to(DTYPES[dtype]))
    store.close()


@pytest.mark.parametrize(
    "dtype,fused,gather_next",
    [
        ("fp32", False, True),  # the master is the parameter shard: its host copy stays
        ("fp32", False, False),
        ("bf16", True, True),  # the native step writes the bf16 weights into the parameter shard's host copy
        ("bf16", False, True),  # give_back casts the master into it
        ("bf16", True, False),
    ],
)
def test_a_step_before_the_gather_leaves_the_new_weights_where_the_gather_reads_them(
    disk_dir, dtype, fused, gather_next
):
    """Parameters and optimizer on NVMe: after a step deferred to the next gather (clipping), the gather reads
    the new weights from the step's host copy, not back from the file; any other step's copy is dropped once
    written. In fp32 that copy is the master; with bf16 compute it is the parameter shard's, made by the step
    without reading the file. The gathered copy then stays cached: backward gathers the same weights again."""
    recorder = MoveCounter()
    cfg = config("mlp", offload_param="nvme", offload_optimizer="nvme", dtype=dtype, clip=1.0,
                 nvme_path=str(disk_dir))  # fmt: skip
    tiers = TierStore(str(disk_dir), AioConfig(), TierBudgets(), recorder=recorder)
    store = ShardStore(tiers, placement_of(cfg, 1), CommGroup(0, 1))
    flat, _ = _add(store)
    assert store.placement.master_is_param == (dtype == "fp32") and not store.placement.step_in_backward
    store.accumulate_grad(flat, torch.randn(flat.shard_numel).to(store.placement.grad_dtype), final=True)
    store.finish_grad_writes()
    read_before_step = recorder.bytes.get("nvme->host", 0)
    lent = store.lend(flat, with_grad=True, gather_next=gather_next)
    _native_step(lent, fused=fused)
    new_weights = lent.master.to(DTYPES[dtype])
    store.give_back(lent, param_written=fused, gather_next=gather_next).finish()
    state_bytes = flat.shard_numel * (4 + 8 + store.placement.grad_dtype.itemsize)  # master, moments, gradient
    assert recorder.bytes.get("nvme->host", 0) - read_before_step == state_bytes  # no read of the 16-bit shard
    read_before = recorder.bytes.get("nvme->host", 0)
    fetched = store.fetch_param(flat).wait()
    assert torch.equal(fetched, new_weights)
    store.release_param(flat)
    param_bytes = flat.shard_numel * DTYPES[dtype].itemsize
    assert recorder.bytes.get("nvme->host", 0) - read_before == (0 if gather_next else param_bytes)
    assert store.tiers.live_bytes(Tier.HOST) == round_up(param_bytes)  # the gathered copy alone, cached
    read_before = recorder.bytes.get("nvme->host", 0)
    assert torch.equal(store.fetch_param(flat).wait(), new_weights)  # backward's gather: a hit
    store.release_param(flat, keep=True)
    assert recorder.bytes.get("nvme->host", 0) == read_before
    assert torch.equal(_read_from_home(store, flat, ShardKind.PARAM), new_weights)  # and the file has them
    store.close()


# -- gradients ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optim", ["cpu", "nvme"])
def test_accumulate_grad_sums_the_micro_batches_and_notes_the_final_norm(disk_dir, optim):
    store = _store(disk_dir, 1, "cpu", optim, "fp32", clip=1.0)  # clipping: the norm is needed
    flat, _ = _add(store)
    parts = [torch.randn(flat.shard_numel) for _ in range(3)]
    for i, part in enumerate(parts):
        store.accumulate_grad(flat, part, final=i == 2)
    total = parts[0] + parts[1] + parts[2]
    store.finish_grad_writes()
    assert torch.equal(_read_from_home(store, flat, ShardKind.GRAD), total)
    assert store.local_grad_norm_sq() == pytest.approx(float(total.norm()) ** 2, rel=1e-6)
    store.zero_grad()
    assert not store.records[flat].has_grad and store.local_grad_norm_sq() == 0.0
    store.close()


@pytest.mark.parametrize("optim", ["cpu", "nvme"])
def test_final_grad_adds_the_accumulated_micro_batches_to_the_last(disk_dir, optim):
    store = _store(disk_dir, 1, "nvme", optim, "fp32", clip=0.0)
    earlier, fresh = _add(store, "a#0"), _add(store, "b#0")
    parts = [torch.randn(earlier[0].shard_numel) for _ in range(3)]
    store.accumulate_grad(earlier[0], parts[0], final=False)
    store.accumulate_grad(earlier[0], parts[1], final=False)
    assert torch.equal(store.final_grad(earlier[0], parts[2]), (parts[0] + parts[1]) + parts[2])
    assert torch.equal(store.final_grad(fresh[0], parts[2]), parts[2])  # nothing accumulated: the last alone
    assert store.records[earlier[0]].has_grad and store.records[fresh[0]].has_grad  # consumed by the step
    store.close()


# -- the registry ---------------------------------------------------------------------------------------------


def test_the_registry_names_each_parameters_flat_and_store_until_close(disk_dir):
    store = _store(disk_dir, 1, "cpu", "cpu", "fp32")
    flat, _ = _add(store)
    (param,) = flat.params
    assert owner_of(param) == (flat, store)
    assert owner_of(nn.Parameter(torch.zeros(3))) is None
    store.close()
    assert owner_of(param) is None
