"""Turning a model into sharded blocks, block by block: materialize, flatten, hand the bytes to the store.

The whole model never exists at once when it was built on the meta device: each block is
materialized with its own initializers just before its parameters are flattened and sharded.
"""

from __future__ import annotations

import torch
from torch import nn

from infinity.comm import CommGroup
from infinity.partition import BlockPlan, FlatParam
from infinity.partition.blocks import ParamUse, flat_groups
from infinity.partition.materialize import materialize_modules
from infinity.partition.sharded_block import ShardedBlock
from infinity.shards.store import ShardStore


def shard_model(
    model: nn.Module,
    plan: BlockPlan,
    group_of: dict[int, int],
    shards: ShardStore,
    comm: CommGroup,
    sub_group_elems: int,
) -> tuple[list[ShardedBlock], ShardedBlock, ShardedBlock]:
    """(the blocks in module order, the root, the persistent set), every parameter's bytes in `shards`;
    flats hold at most `sub_group_elems` elements each (`flat_groups`)."""
    cpu = torch.device("cpu")
    blocks = []

    def flats_of(name: str, uses: list[ParamUse], persistent: bool) -> list[FlatParam]:
        return _shard_flats(name, flat_groups(uses, group_of, sub_group_elems), persistent, shards, comm)

    for i, (name, module, uses) in enumerate(plan.blocks):
        materialize_modules(module.modules(), model, cpu)
        blocks.append(ShardedBlock(i, name, module, flats_of(name, uses, False)))
    materialize_modules(model.modules(), model, cpu)
    root = ShardedBlock(-1, "<root>", model, flats_of("<root>", plan.root, False))
    return blocks, root, ShardedBlock(-2, "<persistent>", None, flats_of("<persistent>", plan.persistent, True))


def _shard_flats(
    name: str,
    groups: list[tuple[str, int | None, list[ParamUse]]],
    persistent: bool,
    shards: ShardStore,
    comm: CommGroup,
) -> list[FlatParam]:
    """One FlatParam per entry of `groups`, each handed to the store at once."""
    placement = shards.placement
    flats = []
    for tag, group_index, uses in groups:
        members = []
        for fqn, _, param_uses in uses:
            module, attr = param_uses[0]
            members.append((fqn, module._parameters[attr], param_uses))  # materialized: maybe a new parameter
        flat = FlatParam(
            f"{name}#{tag}",
            members,
            placement.compute_dtype,
            placement.compute_device,
            comm,
            group_index,
            persistent,
        )
        full32 = flat.initial_full_fp32()
        flat.install_views()  # from here on the parameters are views into the flat buffer
        shards.add(flat, full32)
        if not flat.resident:
            if persistent:  # persistent weights stay gathered: the full values are in place already
                with torch.no_grad():
                    flat.full.copy_(full32)
            else:
                flat.reshard()
        flats.append(flat)
    return flats
