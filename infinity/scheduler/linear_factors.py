"""LinearFactors: a block's weight gradients kept as the two small matrices they are made of, where they are small.

A linear layer's weight gradient is the product of its output's gradient and its input over every token
(dY^T X). Where a call passes few tokens (a large model trained on a batch of a few rows, out of core), the two
factors are a small fraction of the gradient's bytes, and one matrix product rebuilds it: the gradient replay
(`BlockInputs.recompute`) then needs neither the block's forward nor the rest of its backward, which at that
shape read every weight twice more than the product writes the gradient once.

Kept for a block's captured call (`BlockInputs`) where every trainable parameter of the block that got a
gradient is either the weight of an `nn.Linear` (its class's forward, no other module holding the weight)
called once in the call and its weight read by nothing else in it (`ParamAccessDict.reads`: other code may
give it gradient too), or one whose gradient itself is kept (norms, biases), and all of it, counted as the
storages it keeps alive, is at most FACTOR_SHARE of the block's gradient bytes (so that all blocks' factors
together stay a small part of the memory the gradients would take). Otherwise nothing is kept and the replay
runs the block again. The input is taken before any other forward hook of the linear layer sees the output,
and the output's gradient as the layer's backward receives it (after any hook on the output changed it). The
product is the one autograd makes for the weight (`weight_grad`: the same matrix call on the same operands),
and the replay's trial and norm check verify the result either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from infinity.partition.sharded_block import ShardedBlock
from infinity.scheduler.param_access import ParamAccessDict

# the most a block's factors may take, as a share of its gradient's bytes: all blocks' together, at most an eighth
# of a byte per fp32 parameter
FACTOR_SHARE = 1 / 32


@dataclass
class _Kept:
    """One captured call's factors: (input, output gradient) per linear weight and the other gradients."""

    training_pass: int
    limit: int  # bytes
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # trainable index -> the linear's input
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # trainable index -> its output's gradient
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # trainable index -> a gradient kept as is
    arrived: set[int] = field(default_factory=set)  # trainable indices whose gradient backward made
    versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # factors and their versions when kept
    weight_reads: dict[int, int] = field(default_factory=dict)  # linear weight index -> its reads before the call
    storages: set[int] = field(default_factory=set)  # the storages counted in nbytes
    nbytes: int = 0
    why_not: str | None = None

    def add_bytes(self, t: torch.Tensor) -> None:
        """Count the memory `t` keeps alive: its whole storage (a view holds all of it), once."""
        storage = t.untyped_storage()
        if storage.data_ptr() in self.storages:
            return
        self.storages.add(storage.data_ptr())
        self._count(storage.nbytes())

    def add_excess(self, t: torch.Tensor) -> None:
        """Count what `t`'s storage holds beyond `t` itself (its own bytes were counted ahead)."""
        self._count(max(0, t.untyped_storage().nbytes() - t.numel() * t.element_size()))

    def _count(self, nbytes: int) -> None:
        self.nbytes += nbytes
        if self.nbytes > self.limit:
            self.give_up("its factors would take more than the share of its gradient they are kept within")

    def give_up(self, why: str) -> None:
        self.why_not = self.why_not or why
        self.inputs.clear()
        self.output_grads.clear()
        self.grads.clear()
        self.versions.clear()
        self.storages.clear()


class LinearFactors:
    """Keeps each block's weight-gradient factors for its captured call (see the module docstring)."""

    def __init__(
        self,
        blocks: list[ShardedBlock],
        capturing: Callable[[ShardedBlock], int | None],
        current_pass: Callable[[], int],
    ) -> None:
        """`capturing(block)`: the training pass whose call of `block` is being captured now, or None;
        `current_pass()`: the last training forward's (whose backward runs)."""
        self._capturing = capturing
        self._current_pass = current_pass
        self._kept: dict[int, _Kept] = {}
        self._limit: dict[int, int] = {}
        self._linears: dict[int, list[tuple[nn.Module, int]]] = {}  # block -> (linear, its weight's index)
        self._handles = []
        self.products = 0  # weight gradients rebuilt (a counter)
        self.products_in_place = 0  # of them, made in the memory they are handed over in
        for block in blocks:
            index = {id(p): i for i, p in enumerate(block.trainable)}
            uses = {id(p): slot.uses for f in block.flats for p, slot in zip(f.params, f.slots, strict=True)}
            self._limit[block.index] = int(
                FACTOR_SHARE * sum(f.numel * f.full.element_size() for f in block.flats if f.requires_grad)
            )
            linears = self._linears.setdefault(block.index, [])
            for module in block.module.modules() if block.module is not None else ():
                weight = getattr(module, "weight", None)
                if (
                    isinstance(module, nn.Linear)
                    and type(module).forward is nn.Linear.forward
                    and id(weight) in index
                    and uses[id(weight)] == ((module, "weight"),)  # no other module holds it (a tied embedding)
                ):
                    linears.append((module, index[id(weight)]))
                    # first of its forward hooks: the output as the layer made it, before a hook replaces it
                    hook = module.register_forward_hook(self._on_linear(block, index[id(weight)]), prepend=True)
                    self._handles.append(hook)
            for i, p in enumerate(block.trainable):
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad(block, i)))

    def begin(self, block: ShardedBlock, training_pass: int) -> None:
        """`block`'s call in `training_pass` begins and is captured: keep its factors."""
        kept = _Kept(training_pass, self._limit[block.index])
        for module, i in self._linears[block.index]:
            if not isinstance(module._parameters, ParamAccessDict):
                kept.give_up("the reads of its weights are not counted")
                break
            kept.weight_reads[i] = module._parameters.reads.get("weight", 0)
        self._kept[block.index] = kept

    def end(self, block: ShardedBlock) -> None:
        """`block`'s captured call returned: a linear weight read more than its own forward read it may have
        gradient from elsewhere, which its factors do not hold."""
        kept = self._live(block)
        if kept is None:
            return
        for module, i in self._linears[block.index]:
            counted = getattr(module._parameters, "reads", None)  # (none once the engine closed)
            if counted is None:
                kept.give_up("the reads of its weights are not counted")
                return
            reads = counted.get("weight", 0) - kept.weight_reads[i]
            if reads > (1 if i in kept.inputs else 0):
                kept.give_up("a linear layer's weight is read by other code in its call")
                return

    def drop(self, block: ShardedBlock) -> None:
        """Forget `block`'s factors (its gradient was recomputed, or its call can no longer be replayed)."""
        self._kept.pop(block.index, None)

    def _live(self, block: ShardedBlock) -> _Kept | None:
        kept = self._kept.get(block.index)
        if kept is None or kept.why_not is not None or self._capturing(block) != kept.training_pass:
            return None
        return kept

    def _on_linear(self, block: ShardedBlock, index: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            kept = self._live(block)
            if kept is None:
                return
            if index in kept.inputs:
                kept.give_up("a linear layer of it is called more than once in a forward")
                return
            if "forward" in module.__dict__:  # a wrapper set on the instance: what it multiplies is not `args`
                kept.give_up("a linear layer of it has its forward replaced")
                return
            if not args or args[0].dim() < 2 or output.grad_fn is None:
                kept.give_up("a linear layer of it is called with a keyword, on a single row or without autograd")
                return
            x = args[0].detach()
            kept.inputs[index] = x
            kept.versions.append((x, x._version))
            kept.add_bytes(x)  # once for q, k and v, which share their input
            kept.add_bytes(output)  # its gradient's, to come (and what more its storage holds, as it comes)
            if kept.why_not is not None:
                return
            # the gradient the layer's backward receives: after the output's own hooks, which may change it
            output.grad_fn.register_prehook(self._on_output_grad(kept, index))

        return hook

    @staticmethod
    def _on_output_grad(kept: _Kept, index: int):
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            if kept.why_not is None and grads[0] is not None:
                grad = grads[0].detach()
                kept.output_grads[index] = grad
                kept.versions.append((grad, grad._version))
                kept.add_excess(grad)  # a view of a larger gradient keeps all of it

        return hook

    def _on_grad(self, block: ShardedBlock, index: int):
        def hook(param: torch.Tensor) -> None:
            kept = self._kept.get(block.index)
            if kept is None or kept.why_not is not None or kept.training_pass != self._current_pass():
                return
            kept.arrived.add(index)
            if index in kept.inputs:
                return
            if param.grad is None:  # taken already (a reduction triggered by this very gradient)
                kept.give_up("its gradients were reduced as they arrived")
                return
            kept.add_bytes(param.grad)
            if kept.why_not is None:  # (not cloned where it would take more than the share)
                kept.grads[index] = param.grad.detach().clone()

        return hook

    def ready(self, block: ShardedBlock, training_pass: int) -> bool:
        """Whether `block`'s gradients from `training_pass`'s backward can be rebuilt by `grads`."""
        kept = self._kept.get(block.index)
        return (
            kept is not None
            and kept.why_not is None
            and kept.training_pass == training_pass
            and all(i in kept.output_grads for i in kept.arrived if i in kept.inputs)
            and all(_pair(kept.inputs[i], kept.output_grads[i]) for i in kept.arrived if i in kept.inputs)
            and all(t._version == v for t, v in kept.versions)
        )

    def grads(self, block: ShardedBlock, into: Mapping[int, torch.Tensor]) -> list[torch.Tensor | None]:
        """The gradients of `block.trainable` (None where backward made none), rebuilt from the factors kept; a
        weight's product is made in `into[i]` where given and it fits there (`_fits`): the memory its gradient
        is handed over in, so no fresh memory and no copy."""
        kept = self._kept[block.index]
        out: list[torch.Tensor | None] = []
        for i in range(len(block.trainable)):
            if i not in kept.arrived:
                out.append(None)
            elif i in kept.inputs:
                x, dy = kept.inputs[i], kept.output_grads[i]
                home = into.get(i)
                self.products += 1
                if home is not None and _fits(home, x):
                    self.products_in_place += 1
                    out.append(weight_grad(x, dy, out=home))
                else:
                    out.append(weight_grad(x, dy))
            else:
                out.append(kept.grads[i])
        return out

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._kept.clear()


def weight_grad(x: torch.Tensor, dy: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A linear weight's gradient from its input `x` and its output's gradient `dy` (any leading dimensions):
    the product autograd makes for it, the output gradient's transpose times the input; made in `out` if given
    (the weight's shape and the factors' dtype)."""
    dy, x = dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1])
    return dy.mm(x) if out is None else torch.mm(dy, x, out=out)


def _fits(home: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a product of `x`'s dtype can be made in `home` with the bits of one made in fresh memory: same
    dtype and device, contiguous; on a GPU 256-byte aligned as fresh memory is (a BLAS may choose its kernel,
    and so its order of sums, by the output's alignment; on this CPU, checked, it does not)."""
    aligned = home.device.type == "cpu" or home.data_ptr() % 256 == 0
    return home.dtype == x.dtype and home.device == x.device and home.is_contiguous() and aligned


def _pair(x: torch.Tensor, dy: torch.Tensor) -> bool:
    """Whether `x` and `dy` are one call's input and output gradient: one dtype, as many rows."""
    return x.dtype == dy.dtype and x.numel() // x.shape[-1] == dy.numel() // dy.shape[-1]
