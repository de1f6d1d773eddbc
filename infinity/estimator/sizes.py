"""What the estimate needs to know of a model: its parameter count, its largest block, and its flats."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from infinity.config import ZeroConfig
from infinity.partition import plan_blocks
from infinity.partition.blocks import flat_groups


@dataclass(frozen=True)
class ModelSize:
    """Parameter counts the estimate needs: all distinct parameters, those of the largest block (the unit
    gathered and reduced at once), and, where known, each flat's (the unit every shard slot is padded for:
    `module_size`): the trainable flats (`flat_params`) and those of frozen parameters (`frozen_flat_params`:
    a parameter slot only, no master, moments or gradient). Without `flat_params` the trainable parameters
    are taken as flats of the largest block's size."""

    total_params: int
    largest_block_params: int
    flat_params: tuple[int, ...] = ()
    frozen_flat_params: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        counts = (self.total_params, self.largest_block_params, *self.flat_params, *self.frozen_flat_params)
        if any(n < 0 for n in counts):
            raise ValueError(f"parameter counts must be >= 0, got {self}")
        if self.frozen_params > self.total_params:
            raise ValueError(
                f"frozen_flat_params sum to {self.frozen_params}, more than total_params={self.total_params}"
            )
        if self.flat_params and sum(self.flat_params) != self.trainable_params:
            raise ValueError(
                f"flat_params sum to {sum(self.flat_params)}, not total_params={self.total_params} less the "
                f"{self.frozen_params} frozen: list every flat of the model once"
            )

    @property
    def frozen_params(self) -> int:
        return sum(self.frozen_flat_params)

    @property
    def trainable_params(self) -> int:
        return self.total_params - self.frozen_params

    def flat_counts(self) -> list[tuple[int, int]]:
        """(elements of a trainable flat, how many flats of that size): the given flats, else as many flats of
        the largest block as the trainable parameters fill and one of the rest."""
        if self.flat_params:
            return sorted(Counter(self.flat_params).items())
        trainable = self.trainable_params
        largest = self.largest_block_params or trainable
        if largest == 0 or trainable == 0:
            return []
        full, rest = divmod(trainable, largest)
        return [(largest, full)] + ([(rest, 1)] if rest else [])

    def frozen_flat_counts(self) -> list[tuple[int, int]]:
        """(elements of a frozen flat, how many flats of that size)."""
        return sorted(Counter(self.frozen_flat_params).items())

    @property
    def largest_flat_params(self) -> int:
        """The optimizer's unit: the largest trainable flat (the largest block where flats are not known)."""
        return max(self.flat_params) if self.flat_params else self.largest_block_params or self.total_params


def size_from_params(total_params: float) -> ModelSize:
    """A GPT-shaped guess of the largest block for a bare parameter count.

    Transformers keep depth near hidden/128 (GPT-3 13B: h=5120, 40 layers), so P ~ 12 h^2 * h/128 and
    the largest block is one layer of 12 h^2 parameters.
    """
    p = int(total_params)
    hidden = (p * 128 / 12) ** (1 / 3)
    return ModelSize(p, min(p, int(12 * hidden * hidden)))


def module_size(model: nn.Module, zero: ZeroConfig | None = None) -> ModelSize:
    """The counts of `model` (built on the meta device or not) with its flats laid out as the engine lays
    them out under `zero` (block_classes, block_size_elems, stage3_param_persistence_threshold,
    sub_group_size; its defaults when None): one flat per block, the root and the persistent set, split at
    sub_group_size. Parameters that do not require gradients form frozen flats, as the engine lays them out
    (`flat_groups`); every trainable one is counted in one param group."""
    z = zero if zero is not None else ZeroConfig()
    threshold = z.stage3_param_persistence_threshold
    if not isinstance(threshold, int):
        raise ValueError(f"stage3_param_persistence_threshold is {threshold!r}: resolve 'auto' first")
    plan = plan_blocks(model, tuple(z.block_classes), z.block_size_elems, threshold)
    uses = [plan.root, plan.persistent, *(b[2] for b in plan.blocks)]
    group_of = {id(p): 0 for p in model.parameters() if p.requires_grad}  # frozen: no group (None)
    flats: dict[bool, list[int]] = {True: [], False: []}  # by trainable
    for u in uses:
        for _, group, run in flat_groups(u, group_of, z.sub_group_size):
            flats[group is not None].append(sum(p.numel() for _, p, _ in run))
    largest = max((sum(p.numel() for _, p, _ in u) for u in uses), default=0)
    total = sum(flats[True]) + sum(flats[False])
    return ModelSize(total, largest, tuple(flats[True]), tuple(flats[False]))


def gpt_model_size(preset: str, zero: ZeroConfig | None = None, **overrides) -> ModelSize:
    """Exact counts for a GPT preset (fields replaced by `overrides`, e.g. block_size), built on the meta
    device (no memory is allocated). Blocks are the GPT's layers (its `Block` modules) unless `zero` names
    another layout; without `zero` nothing is persistent, so the largest block is a whole layer or the root."""
    import torch

    from infinity.models.gpt import GPT, gpt_preset

    with torch.device("meta"):
        model = GPT(gpt_preset(preset, **overrides))
    if zero is None:
        zero = ZeroConfig(block_classes=("Block",), stage3_param_persistence_threshold=0)
    return module_size(model, zero)
