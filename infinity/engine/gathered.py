"""`GatheredParameters`: full weights of sharded parameters outside forward, as DeepSpeed's context manager.

Parameters are looked up in the shard registry (no back-pointer on them); the weights come from and
go back to their shard store.
"""

from __future__ import annotations

import torch
from torch import nn

from infinity.partition import FlatParam
from infinity.shards.registry import owner_of
from infinity.shards.store import ShardKind, ShardStore


class GatheredParameters:
    """Full weights of sharded parameters inside the block; written back to the shards on exit when
    `modifier_rank` is given (that rank's values are broadcast to all first)."""

    def __init__(self, params: nn.Parameter | list[nn.Parameter], modifier_rank: int | None = None) -> None:
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.owners: dict[FlatParam, ShardStore] = {}
        for p in params:
            owner = owner_of(p)
            if owner is not None:
                self.owners.setdefault(*owner)
        self.modifier_rank = modifier_rank
        self._was_unsharded: list[bool] = []
        self._saved: dict[FlatParam, torch.Tensor] = {}

    def __enter__(self) -> None:
        for flat, store in self.owners.items():
            self._was_unsharded.append(flat.unsharded)
            if flat.resident:  # the weights are the shard itself: keep them to restore unless modified
                self._saved[flat] = flat.full.clone()
            if not flat.unsharded:
                flat.unshard(store.read(flat, ShardKind.PARAM).to(flat.full.device))

    @torch.no_grad()
    def __exit__(self, *exc) -> None:
        for (flat, store), was_unsharded in zip(self.owners.items(), self._was_unsharded, strict=True):
            if self.modifier_rank is not None and exc[0] is None:
                store.comm.broadcast(flat.full, self.modifier_rank, f"modified weights of {flat.name}")
                start, end = flat.shard_range
                store.assign(flat, flat.full[start:end].float())
            elif flat in self._saved:  # changes without a modifier (or cut short by an error) are discarded
                flat.full.copy_(self._saved[flat])
            elif was_unsharded:  # ... also on always-gathered weights
                flat.unshard(store.read(flat, ShardKind.PARAM).to(flat.full.device))
            if not was_unsharded:
                flat.reshard()
        self._saved.clear()
        self._was_unsharded.clear()
