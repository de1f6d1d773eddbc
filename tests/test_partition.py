"""Partition: which block owns each parameter (`plan_blocks`), a block's flat buffer (`FlatParam`) and the
states of its gather (`ShardedBlock`), the last over a real shard store with its shards on NVMe."""

from __future__ import annotations

import pytest
import torch
from harness import config, placement_of
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from toy_models import SharedLinearNet, make_model

from infinity.comm import CommGroup
from infinity.config import AioConfig, ConfigError
from infinity.engine.sharding import shard_model
from infinity.models.mlp import MLPLayer
from infinity.partition import FlatParam, plan_blocks
from infinity.partition.flat_param import SHARD_ALIGN_ELEMS, FlatState
from infinity.partition.sharded_block import BlockState, ShardedBlock
from infinity.shards import ShardKind, ShardStore
from infinity.storage import TierBudgets, TierStore

pytestmark = pytest.mark.unit
pytest_plugins = ["storage_fixtures"]  # disk_dir: a directory on a disk that takes O_DIRECT

ONE_RANK = CommGroup(0, 1)


def _names(uses) -> list[str]:
    return [fqn for fqn, _, _ in uses]


def _blocks(plan) -> dict[str, list[str]]:
    return {name: _names(uses) for name, _, uses in plan.blocks}


# -- plan_blocks ------------------------------------------------------------------------------------------


def test_block_classes_make_each_module_of_those_classes_a_block():
    model = make_model("gpt")
    plan = plan_blocks(model, ("Block",), block_size_elems=1, persistence_threshold=0)
    assert list(_blocks(plan)) == ["blocks.0", "blocks.1"]
    assert _blocks(plan)["blocks.1"] == [fqn for fqn, _ in model.blocks[1].named_parameters(prefix="blocks.1")]
    assert _names(plan.root) == ["wte.weight", "wpe.weight", "ln_f.weight"]  # outside every block
    assert plan.persistent == []


def test_a_block_class_nested_inside_another_listed_class_is_no_error_and_the_outer_module_is_the_block():
    model = make_model("gpt")  # each Block holds a FeedForward
    plan = plan_blocks(model, ("Block", "FeedForward"), block_size_elems=1, persistence_threshold=0)
    assert _blocks(plan) == _blocks(plan_blocks(model, ("Block",), block_size_elems=1, persistence_threshold=0))


def test_a_block_class_the_model_lacks_is_refused_naming_it_and_the_classes_present():
    with pytest.raises(ConfigError, match=r"'zero_optimization.block_classes' names \['Blokc'\].*MLPLayer"):
        plan_blocks(make_model("mlp"), ("MLPLayer", "Blokc"), block_size_elems=1, persistence_threshold=0)


@pytest.mark.parametrize(
    "block_size,blocks",
    [
        (5000, ["layers", "head"]),  # each child of the model fits: one block each
        (1000, ["layers.0", "layers.1", "layers.2", "head"]),  # layers (1608) is split into its children
        (100, ["layers.0.fc", "layers.1.fc", "layers.2.fc", "head"]),  # down to leaves, which stay whole
    ],
)
def test_without_block_classes_the_walk_splits_children_larger_than_the_block_size(block_size, blocks):
    model = make_model("mlp")  # layers: 16x24+24, 2 x (24x24+24) = 1608 elements; head: 24x8+8 = 200
    plan = plan_blocks(model, (), block_size_elems=block_size, persistence_threshold=0)
    assert list(_blocks(plan)) == blocks
    assert sum(len(fqns) for fqns in _blocks(plan).values()) == len(list(model.parameters()))
    assert plan.root == []


def test_a_parameter_two_blocks_share_belongs_to_the_root():
    model = SharedLinearNet()  # layers.1.fc is layers.2.fc
    plan = plan_blocks(model, ("MLPLayer",), block_size_elems=1, persistence_threshold=0)
    assert _names(plan.root) == ["layers.1.fc.weight", "layers.1.fc.bias", "head.weight", "head.bias"]
    assert list(_blocks(plan)) == ["layers.0", "layers.3"]  # blocks left without parameters of their own go
    shared = next(p for fqn, p, _ in plan.root if fqn == "layers.1.fc.weight")
    assert shared is model.layers[2].fc.weight


def test_a_tied_weight_lists_every_module_that_uses_it():
    model = make_model("gpt")  # lm_head.weight is wte.weight
    plan = plan_blocks(model, ("Block",), block_size_elems=1, persistence_threshold=0)
    (uses,) = [uses for fqn, _, uses in plan.root if fqn == "wte.weight"]
    assert uses == ((model.wte, "weight"), (model.lm_head, "weight"))
    assert "lm_head.weight" not in _names(plan.root)  # one entry per tensor


def test_parameters_below_the_persistence_threshold_are_persistent_wherever_they_are_used():
    model = make_model("mlp")  # biases of 24 and 8 elements; weights of 384 and more
    plan = plan_blocks(model, ("MLPLayer",), block_size_elems=1, persistence_threshold=25)
    assert _names(plan.persistent) == ["layers.0.fc.bias", "layers.1.fc.bias", "layers.2.fc.bias", "head.bias"]
    assert _blocks(plan) == {f"layers.{i}": [f"layers.{i}.fc.weight"] for i in range(3)}
    assert _names(plan.root) == ["head.weight"]


# -- FlatParam ------------------------------------------------------------------------------------------------


def _flat(module: nn.Module, comm: CommGroup = ONE_RANK, group_index: int | None = 0) -> FlatParam:
    params = [(fqn, p, ((module, fqn),)) for fqn, p in module.named_parameters()]
    return FlatParam("m#0", params, torch.float32, torch.device("cpu"), comm, group_index, persistent=False)


@pytest.mark.parametrize(
    "numel,world,shard_elems",
    [
        (98, 1, 1024),  # everything rounds up to one aligned shard
        (98, 2, 1024),
        (5000, 1, 5120),
        (5000, 2, 3072),  # 2500 per rank -> 3 x 1024
        (5000, 3, 2048),  # 1667 per rank -> 2 x 1024
    ],
)
def test_shards_are_padded_to_the_alignment_and_divide_the_flat_by_the_world_size(numel, world, shard_elems):
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(numel))
    flat = _flat(module, CommGroup(world - 1, world))  # the last rank's view; no collective is called
    assert flat.numel == numel
    assert flat.shard_numel == shard_elems and shard_elems % SHARD_ALIGN_ELEMS == 0
    assert flat.padded_numel == world * shard_elems
    assert flat.shard_range == ((world - 1) * shard_elems, world * shard_elems)


def test_parameters_are_views_of_their_range_of_the_flat_buffer():
    layer = MLPLayer(4, 3)  # fc.weight 3x4 at [0, 12), fc.bias 3 at [12, 15)
    flat = _flat(layer)
    full32 = flat.initial_full_fp32()
    assert torch.equal(full32[:12], layer.fc.weight.detach().reshape(-1))
    assert torch.equal(full32[12:15], layer.fc.bias.detach()) and not full32[15:].any()
    flat.install_views()
    flat.full.copy_(torch.arange(flat.padded_numel, dtype=torch.float32))
    assert layer.fc.weight.shape == (3, 4) and torch.equal(layer.fc.weight.detach().reshape(-1), torch.arange(12.0))
    assert torch.equal(layer.fc.bias.detach(), torch.tensor([12.0, 13.0, 14.0]))
    assert layer.fc.bias.data_ptr() == flat.full.data_ptr() + 12 * 4
    assert {k: v.tolist() for k, v in flat.unflatten(torch.arange(15)).items()} == {
        "fc.weight": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]],
        "fc.bias": [12, 13, 14],
    }


def test_reshard_frees_the_buffer_and_unshard_refills_it_under_the_tensors_autograd_saved():
    torch.manual_seed(0)
    layer, plain = MLPLayer(4, 3), MLPLayer(4, 3)
    plain.load_state_dict(layer.state_dict())
    flat = _flat(layer)
    full32 = flat.initial_full_fp32()
    flat.install_views()
    flat.full.copy_(full32)
    x = torch.randn(5, 4)
    loss = layer(x).square().sum()  # autograd saves the weight views for backward
    flat.reshard()
    assert flat.state is FlatState.SHARDED and flat.full.untyped_storage().nbytes() == 0
    assert layer.fc.weight.numel() == 0 and layer.fc.bias.numel() == 0
    assert flat.unshard(full32) is None  # one rank: the "all-gather" is a copy, done at once
    assert flat.state is FlatState.UNSHARDED and flat.full.untyped_storage().nbytes() == flat.padded_numel * 4
    assert torch.equal(layer.fc.weight.detach(), plain.fc.weight.detach())
    loss.backward()
    plain(x).square().sum().backward()
    torch.testing.assert_close(layer.fc.weight.grad, plain.fc.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.fc.bias.grad, plain.fc.bias.grad, rtol=0, atol=0)


def _flat_with_grads() -> tuple[FlatParam, torch.Tensor]:
    module = nn.Module()
    module.a = nn.Parameter(torch.zeros(3, 4))
    module.b = nn.Parameter(torch.zeros(5))  # left without a gradient
    module.c = nn.Parameter(torch.zeros(2))
    flat = _flat(module)
    module.a.grad = torch.arange(12.0).view(3, 4)
    module.c.grad = torch.tensor([-1.0, -2.0])
    return flat, torch.full((flat.padded_numel,), 7.0)


def test_grads_into_writes_the_gradients_and_zeros_where_a_parameter_has_none():
    flat, out = _flat_with_grads()
    assert flat.grads_into(out, accumulate=False)
    assert torch.equal(out[:12], torch.arange(12.0))
    assert not out[12:17].any()  # b: no gradient is a zero gradient
    assert torch.equal(out[17:19], torch.tensor([-1.0, -2.0]))
    assert not out[19:].any()  # the padding


def test_grads_into_with_accumulate_adds_and_leaves_the_rest_as_it_was():
    flat, out = _flat_with_grads()
    assert flat.grads_into(out, accumulate=True)
    assert torch.equal(out[:12], 7.0 + torch.arange(12.0))
    assert torch.equal(out[12:17], torch.full((5,), 7.0))
    assert torch.equal(out[17:19], torch.tensor([6.0, 5.0]))
    assert torch.equal(out[19:], torch.full((flat.padded_numel - 19,), 7.0))


def test_a_gradient_made_in_its_piece_of_the_flat_is_not_copied_and_the_others_are():
    """A replay makes some gradients in the flat they are handed over in (`GradientReplay`): those are left
    alone (no copy of their bytes), the rest are copied, and a gradient equal to its piece elsewhere is copied."""
    flat, out = _flat_with_grads()
    a = flat.params[0]
    a.grad = out[:12].view(3, 4)
    a.grad.copy_(torch.arange(12.0).view(3, 4))
    copies = _CopyCount()
    with copies:
        assert flat.grads_into(out, accumulate=False)
    assert copies.numels == [2]  # c's only: a was made there
    assert torch.equal(out[:12], torch.arange(12.0))
    assert not out[12:17].any() and not out[19:].any()
    assert torch.equal(out[17:19], torch.tensor([-1.0, -2.0]))
    a.grad = out[:12].clone().view(3, 4)  # same values, its own memory
    with copies:
        flat.grads_into(out, accumulate=False)
    assert copies.numels == [2, 12, 2]


class _CopyCount(TorchDispatchMode):
    """The number of elements of each copy made meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.numels.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def test_without_any_gradient_grads_into_touches_nothing_and_says_so():
    flat, out = _flat_with_grads()
    flat.clear_grads()
    assert not flat.grads_into(out, accumulate=False)
    assert torch.equal(out, torch.full_like(out, 7.0))
    assert flat.flat_grad() is None


def test_make_resident_makes_a_buffer_the_parameters_storage_for_good():
    layer = MLPLayer(4, 3)
    flat = _flat(layer)
    with pytest.raises(ValueError, match="m#0: a resident buffer must hold the whole flat"):
        flat.make_resident(torch.zeros(flat.padded_numel - 1))
    with pytest.raises(ValueError, match="m#0: a resident buffer must hold the whole flat in torch.float32"):
        flat.make_resident(torch.zeros(flat.padded_numel, dtype=torch.bfloat16))
    home = flat.initial_full_fp32()
    flat.make_resident(home)
    assert flat.state is FlatState.RESIDENT and flat.unsharded and flat.resident
    assert layer.fc.weight.data_ptr() == home.data_ptr()
    flat.reshard()  # nothing to free
    assert flat.state is FlatState.RESIDENT and layer.fc.weight.data_ptr() == home.data_ptr()
    with pytest.raises(RuntimeError, match="m#0 is resident: there is nothing to gather"):
        flat.unshard(home)


# -- ShardedBlock -----------------------------------------------------------------------------------------


def _sharded(directory, offload_param: str = "nvme") -> tuple[ShardedBlock, dict[str, torch.Tensor], ShardStore]:
    """layers.0 of the mlp, its weight and bias in two param groups (two flats), sharded into a store."""
    model = make_model("mlp")
    weights = {k: v.clone() for k, v in model.layers[0].state_dict(prefix="layers.0.").items()}
    placement = placement_of(config("mlp", offload_param=offload_param, nvme_path=str(directory)))
    store = ShardStore(TierStore(str(directory), AioConfig(), TierBudgets()), placement, ONE_RANK)
    plan = plan_blocks(model, ("MLPLayer",), block_size_elems=1, persistence_threshold=0)
    group_of = {id(model.layers[0].fc.weight): 0, id(model.layers[0].fc.bias): 1}
    blocks, _, _ = shard_model(model, plan, group_of, store, ONE_RANK, sub_group_elems=10**9)
    return blocks[0], weights, store


def _values(block: ShardedBlock) -> dict[str, torch.Tensor]:
    return {"layers.0.fc.weight": block.module.fc.weight.detach(), "layers.0.fc.bias": block.module.fc.bias.detach()}


def test_a_block_goes_from_sharded_through_fetching_and_gathering_to_unsharded_and_back(disk_dir):
    block, weights, store = _sharded(disk_dir)
    assert block.state is BlockState.SHARDED and len(block.flats) == 2
    assert block.module.fc.weight.numel() == 0
    block.start_unshard(store)
    assert block.state is BlockState.FETCHING and block.in_flight and block.holds_memory
    block.issue_gathers(store)
    assert block.state is BlockState.GATHERING and block.ready()  # one rank: gathered as issued
    block.wait_unshard(store)
    assert block.state is BlockState.UNSHARDED and block.unsharded
    for name, value in _values(block).items():
        assert torch.equal(value, weights[name]), name
    for flat in block.flats:  # the fetched host copies went once gathered: the home is the NVMe file
        assert store.tiers.tiers_holding(store.key(flat, ShardKind.PARAM)) == ["nvme"]
    block.reshard()
    assert block.state is BlockState.SHARDED and not block.holds_memory
    assert block.module.fc.weight.numel() == 0 and all(f.full.untyped_storage().nbytes() == 0 for f in block.flats)
    store.close()


def test_wait_unshard_takes_a_sharded_block_through_every_step(disk_dir):
    block, weights, store = _sharded(disk_dir)
    block.wait_unshard(store)
    assert block.state is BlockState.UNSHARDED
    assert all(torch.equal(v, weights[k]) for k, v in _values(block).items())
    store.close()


def test_wrong_transitions_are_refused_naming_the_block_and_its_state(disk_dir):
    block, _, store = _sharded(disk_dir)
    with pytest.raises(RuntimeError, match=r"block layers.0 is sharded, expected \['fetching'\]"):
        block.issue_gathers(store)
    block.start_unshard(store)
    with pytest.raises(RuntimeError, match=r"block layers.0 is fetching, expected \['sharded'\]"):
        block.start_unshard(store)
    with pytest.raises(RuntimeError, match="block layers.0 is fetching: wait for its gather before resharding"):
        block.reshard()
    block.wait_unshard(store)  # the refused calls changed nothing: the gather completes
    with pytest.raises(RuntimeError, match=r"block layers.0 is unsharded, expected \['sharded'\]"):
        block.start_unshard(store)
    block.reshard()
    block.reshard()  # resharding a sharded block is a no-op
    assert block.state is BlockState.SHARDED
    store.close()


def test_a_block_of_resident_flats_is_resident_and_never_gathers(disk_dir):
    block, weights, store = _sharded(disk_dir, offload_param="none")  # one rank, shards where compute reads
    assert block.state is BlockState.RESIDENT and block.unsharded and block.ready()
    assert not block.holds_memory and not block.in_flight
    block.reshard()
    assert block.state is BlockState.RESIDENT
    assert all(torch.equal(v, weights[k]) for k, v in _values(block).items())
    with pytest.raises(RuntimeError, match=r"block layers.0 is resident, expected \['sharded'\]"):
        block.start_unshard(store)
    store.close()
