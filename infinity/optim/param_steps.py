"""Adam steps per parameter inside a flat shard: a parameter that got no gradient in a step is not stepped.

torch.optim.AdamW skips a parameter whose `.grad` is None: its weight, moments and step count stay as they
are (no weight decay, no moment decay). A flat shard holds many parameters. Where some got no gradient in a
step, on any rank and in any micro-batch (an expert no token reached, a head the loss left out), the step
runs over the others only, each with its own step count for its bias correction. The common step, every
parameter with a gradient and every count alike, stays one pass over the whole shard.

Moments stored in bf16 or 8 bits round stochastically along the whole shard (and 8-bit blocks span
parameters), so those formats step every parameter of a flat that got any gradient, as DeepSpeed does. Where
some parameters skipped steps, the flat stays on runs (their counts lag for good); each run still writes its
compute-dtype weights in the same pass, and only the elements between runs are copied.
"""

from __future__ import annotations

from dataclasses import dataclass

from infinity.partition.flat_param import FlatParam
from infinity.shards import ShardStore
from infinity.shards.grad_presence import Presence
from infinity.shards.kinds import ShardRecord


def step_presence(shards: ShardStore, flat: FlatParam) -> Presence:
    """Which of `flat`'s parameters this step updates (`optim.param_steps`): those that got a gradient, where
    the moments are fp32; every one where they round stochastically along the shard (bf16, 8-bit)."""
    return shards.grad_presence(flat) if shards.placement.moments == "fp32" else None


@dataclass(frozen=True)
class Run:
    """Elements [lo, hi) of this rank's shard, stepped with the Adam step count `step` (after the update)."""

    lo: int
    hi: int
    step: int


def any_used(used: tuple[bool, ...] | None) -> bool:
    """Some parameter got a gradient (None: all did)."""
    return used is None or any(used)


def partial_runs(flat: FlatParam, record: ShardRecord, used: tuple[bool, ...] | None) -> list[Run] | None:
    """The runs of this rank's shard to step where the step is not one pass over all of it (some parameter got
    no gradient, or the counts differ); None where it is: every element steps with count `record.step` + 1.
    The padding and the parameters without a gradient are in no run."""
    if (used is None or all(used)) and record.slot_steps is None:
        return None
    begin, end = flat.shard_range
    counts = record.slot_steps or [record.step] * len(flat.slots)
    runs: list[Run] = []
    for slot, got, count in zip(flat.slots, used or (True,) * len(flat.slots), counts, strict=True):
        lo, hi = max(slot.offset, begin) - begin, min(slot.offset + slot.numel, end) - begin
        if not got or lo >= hi:
            continue
        if runs and runs[-1].hi == lo and runs[-1].step == count + 1:
            runs[-1] = Run(runs[-1].lo, hi, count + 1)
        else:
            runs.append(Run(lo, hi, count + 1))
    return runs


def count_step(flat: FlatParam, record: ShardRecord, used: tuple[bool, ...] | None) -> None:
    """Advance `record`'s step counts for a step in which the `used` parameters got a gradient."""
    if (used is None or all(used)) and record.slot_steps is None:
        record.step += 1
        return
    if not any_used(used):
        return
    counts = record.slot_steps or [record.step] * len(flat.slots)
    counts = [c + 1 if got else c for c, got in zip(counts, used or (True,) * len(counts), strict=True)]
    record.step += 1
    record.slot_steps = None if all(c == record.step for c in counts) else counts
