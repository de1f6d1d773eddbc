"""FrozenReads: when backward is done with a block's frozen weights, so that the block may be resharded.

A block's trainable parameters say when autograd is done with them (their gradient hooks), but a frozen
weight has no gradient: a LoRA base or a frozen attention is read by backward to carry the gradient to the
block's inputs, possibly after every trainable gradient of the block has arrived. Any node of the block's
backward that reads a frozen weight lies on a path to the block's inputs or to its trainable parameters, so
once both have their gradients it has run. `FrozenReads` watches the inputs of each training call of a
block with frozen flats (a gradient hook on them all) and says whether a call's input gradients are owed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves

from infinity.partition.sharded_block import ShardedBlock


class FrozenReads:
    """Counts, per block with frozen flats, the training calls whose input gradients backward still owes."""

    def __init__(self, on_inputs_done: Callable[[ShardedBlock], None]) -> None:
        """`on_inputs_done(block)`: backward computed the input gradients of every watched call of `block`."""
        self._on_inputs_done = on_inputs_done
        self._owed: dict[ShardedBlock, int] = {}

    @staticmethod
    def applies(block: ShardedBlock) -> bool:
        """Whether `block` has frozen flats whose gathered weights backward may read."""
        return any(not f.requires_grad for f in block.flats)

    def watch(self, block: ShardedBlock, args: tuple, kwargs: dict) -> None:
        """A training forward call of `block` with these inputs began."""
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not inputs:  # nothing flows back through the inputs: the trainable gradients say it all
            return
        self._owed[block] = self._owed.get(block, 0) + 1
        torch.autograd.graph.register_multi_grad_hook(inputs, lambda _grads: self._arrived(block), mode="all")

    def owes(self, block: ShardedBlock) -> bool:
        """Whether backward may still read `block`'s frozen weights for some call's input gradients."""
        return self._owed.get(block, 0) > 0

    def _arrived(self, block: ShardedBlock) -> None:
        left = self._owed.get(block, 0) - 1
        if left > 0:
            self._owed[block] = left
            return
        self._owed.pop(block, None)
        self._on_inputs_done(block)

    def clear(self) -> None:
        """A pass ended (or a new forward began): hooks that never fired owe nothing any more."""
        self._owed.clear()
