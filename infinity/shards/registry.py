"""Which flat (and shard store) holds a parameter: a weak side table, so parameters carry no back-pointer.

`GatheredParameters` and the engine's double-wrap check look parameters up here; an engine's
`close()` forgets its entries.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from infinity.partition.flat_param import FlatParam

if TYPE_CHECKING:
    from infinity.shards.store import ShardStore

# id(param) -> (a weak reference to it, its flat, the store). Keyed by id: tensors compare elementwise,
# so they cannot be keys of a WeakKeyDictionary. An entry goes when its parameter is collected.
_OWNERS: dict[int, tuple[weakref.ref, FlatParam, ShardStore]] = {}


def register(flat: FlatParam, store: ShardStore) -> None:
    for p in flat.params:
        key = id(p)
        _OWNERS[key] = (weakref.ref(p, lambda _, key=key, owners=_OWNERS: owners.pop(key, None)), flat, store)


def owner_of(param: torch.Tensor) -> tuple[FlatParam, ShardStore] | None:
    """(the flat holding `param`, its shard store), or None for a parameter no live engine shards."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1], entry[2]


def forget(store: ShardStore) -> None:
    for key in [k for k, (_, _, s) in _OWNERS.items() if s is store]:
        del _OWNERS[key]
