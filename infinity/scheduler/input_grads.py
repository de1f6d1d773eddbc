"""InputGrads: when backward has computed a block's input gradients, so that its gradients are whole and it may go.

Each training call's inputs pass through an identity autograd function (as FSDP2's post-backward does) whose
backward runs once this call's uses of them have their gradients: the block's backward is over. Autograd runs
a parameter's gradient accumulation as soon as it is ready and the block's nodes before that identity (they
came later in forward), so every gradient of the block this rank computes is in by then. Two things wait for it:

- The block's gradient reduction. Counting the block's parameters' gradients would say it sooner, but only where
  every parameter gets one on this rank: an expert no row reached leaves the count short on one rank and not
  another, and the ranks would issue their reductions in different orders (mismatched collectives).
- Its resharding, where it holds frozen weights: a frozen weight has no gradient, and a LoRA base or a frozen
  attention is read by backward to carry the gradient to the block's inputs, possibly after every trainable
  gradient of the block has arrived. A hook on the input tensors themselves would wait for every other user
  of a tensor all blocks read, such as a decoder's encoder states.

A call whose graph is freed without a backward owes nothing. A call none of whose inputs requires a gradient
(or whose inputs the flattening cannot see) is owed until backward ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from infinity.partition.sharded_block import ShardedBlock


class _CallToken:
    """Held by one watched call's autograd node alone: fired by its backward, or finalized with its graph."""

    __slots__ = ("fire", "__weakref__")

    def __init__(self, fire: Callable[[], None]) -> None:
        self.fire = fire


class _InputsDone(torch.autograd.Function):
    """Identity on a call's inputs; its backward runs when this call's uses of them have their gradients."""

    @staticmethod
    def forward(ctx, token: _CallToken, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.token = token
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.token.fire()
        return (None, *grads)


class InputGrads:
    """Counts, per block, the training calls whose input gradients backward still owes."""

    def __init__(self, on_inputs_done: Callable[[ShardedBlock], None]) -> None:
        """`on_inputs_done(block)`: backward computed the input gradients of every watched call of `block`."""
        self._on_inputs_done = on_inputs_done
        self._owed: dict[ShardedBlock, int] = {}
        self._pass = 0  # backwards ended: a call of an earlier pass, its graph freed late, settles nothing

    def watch(self, block: ShardedBlock, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A training call of `block` with these inputs begins: the (args, kwargs) to call it with instead, or
        None to keep them (no input requires grad)."""
        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        self._owed[block] = self._owed.get(block, 0) + 1
        if not at:  # none seen (or inputs in objects the flattening does not open): owed until backward ends
            return None
        done, this_pass = [False], self._pass

        def settle(arrived: bool) -> None:
            if not done[0] and self._pass == this_pass:
                done[0] = True
                self._settle(block, arrived)

        token = _CallToken(lambda: settle(True))
        weakref.finalize(token, settle, False)  # the graph freed without a backward (a forward alone)
        outputs = _InputsDone.apply(token, *(leaves[i] for i in at))
        for i, out in zip(at, outputs, strict=True):
            leaves[i] = out
        return tree_unflatten(leaves, spec)

    def owes(self, block: ShardedBlock) -> bool:
        """Whether backward may still read `block`'s weights for some call's input gradients."""
        return self._owed.get(block, 0) > 0

    def _settle(self, block: ShardedBlock, arrived: bool) -> None:
        left = self._owed.get(block, 0) - 1
        if left > 0:
            self._owed[block] = left
            return
        self._owed.pop(block, None)
        if arrived:
            self._on_inputs_done(block)

    def clear(self) -> None:
        """A backward ended: calls whose inputs it never reached owe nothing any more."""
        self._owed.clear()
        self._pass += 1
