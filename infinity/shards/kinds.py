"""The kinds of bytes the shard store keeps per flat, and what it records of each trainable shard."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ShardKind(str, enum.Enum):
    PARAM = "param"  # compute dtype; the whole flat when parameters are resident
    MASTER = "master"  # fp32 weights the optimizer updates
    MOMENTS = "moments"  # both Adam moments packed in the placement's format (`shards.moments.packed_views`)
    GRAD = "grad"  # fp32 sum of this step's micro-batch gradients


OPTIM_KINDS = (ShardKind.MASTER, ShardKind.MOMENTS)


@dataclass
class ShardRecord:
    """What the store knows of one trainable shard beyond its bytes."""

    step: int = 0  # Adam steps taken
    has_grad: bool = False  # the accumulator holds this step's gradient sum
    grad_norm_sq: float | None = None  # of the final gradient, once known (placements that need norms)
    # per parameter (slot order): got a gradient this step in some micro-batch; None: all did (`grad_presence`).
    # This rank's until the ranks agree (`used_agreed`); agreed with a reduction, a tensor (1 where) until read
    used: tuple[bool, ...] | torch.Tensor | None = None
    used_agreed: bool = False
    slot_steps: list[int] | None = None  # per parameter Adam steps where some were skipped; None: each took `step`
