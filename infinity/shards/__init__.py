"""The shard store layer: every byte of each flat parameter on this rank, and the policy placing them.

`Placement` (policy.py) says where each kind of byte lives, decided once; `ShardStore` (store.py)
owns them under one key scheme on the storage layer's tiers and gives the few verbs everyone
needs, its gradient verbs in gradients.py and the optimizer's lend/give-back in lending.py;
`registry` maps parameters to their flat without back-pointers on them.
"""

from infinity.shards.kinds import ShardKind, ShardRecord
from infinity.shards.lending import LentShard, Returned
from infinity.shards.policy import (
    GradReduction,
    MallocTuning,
    Placement,
    StepperKind,
    StepTiming,
    offload_tier,
    resolve_placement,
)
from infinity.shards.store import ShardStore

__all__ = [
    "GradReduction",
    "LentShard",
    "MallocTuning",
    "Placement",
    "Returned",
    "ShardKind",
    "ShardRecord",
    "ShardStore",
    "StepTiming",
    "StepperKind",
    "offload_tier",
    "resolve_placement",
]
