"""Turning a model into sharded blocks, block by block: materialize, flatten, hand the bytes to the store.

The whole model never exists at once when it was built on the meta device: each block is
materialized with its own initializers just before its parameters are flattened and sharded.
"""

from __future__ import annotations

import torch
from torch import nn

from infinity.comm import CommGroup
from infinity.partition import BlockPlan, FlatParam
from infinity.partition.blocks import ParamUse
from infinity.partition.materialize import materialize_modules
from infinity.partition.sharded_block import ShardedBlock
from infinity.shards.store import ShardStore


def shard_model(
    model: nn.Module, plan: BlockPlan, group_of: dict[int, int], shards: ShardStore, comm: CommGroup
) -> tuple[list[ShardedBlock], ShardedBlock, ShardedBlock]:
    """(the blocks in module order, the root, the persistent set), every parameter's bytes in `shards`."""
    cpu = torch.device("cpu")
    blocks = []
    for i, (name, module, uses) in enumerate(plan.blocks):
        materialize_modules(module.modules(), model, cpu)
        blocks.append(ShardedBlock(i, name, module, _shard_flats(name, uses, group_of, False, shards, comm)))
    materialize_modules(model.modules(), model, cpu)
    root = ShardedBlock(-1, "<root>", model, _shard_flats("<root>", plan.root, group_of, False, shards, comm))
    persistent_flats = _shard_flats("<persistent>", plan.persistent, group_of, True, shards, comm)
    return blocks, root, ShardedBlock(-2, "<persistent>", None, persistent_flats)


def _shard_flats(
    name: str, uses: list[ParamUse], group_of: dict[int, int], persistent: bool, shards: ShardStore, comm: CommGroup
) -> list[FlatParam]:
    """One FlatParam per param group (frozen ones apart), each handed to the store at once."""
    by_group: dict[int | None, list] = {}
    for fqn, old_param, param_uses in uses:
        module, attr = param_uses[0]
        current = module._parameters[attr]  # materialization may have replaced a meta parameter
        by_group.setdefault(group_of.get(id(old_param)), []).append((fqn, current, param_uses))
    placement = shards.placement
    flats = []
    for group_index, members in sorted(by_group.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        tag = "frozen" if group_index is None else group_index
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
