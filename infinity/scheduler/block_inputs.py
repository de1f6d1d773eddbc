"""BlockInputs: what each block's forward was given and what gradient its outputs got back, kept so that
the block's parameter gradients can be computed again later (`recompute`) instead of stored.

A block's call is captured when it is its block's only call in a training forward (grad mode on, no
autocast): its inputs (tensors detached, their versions noted), the RNG state it began from, and, in
backward, the gradient each of its outputs received. The block can be replayed (`ready`) only if its
gradient came from that call alone and the call can be repeated: no other code read its parameters and
it read no other block's or the root's (`param_access`), no input is a view of gathered weights, no input
was changed in place since, the call changed no buffer of the block (running statistics), and it was not
called again. Running its forward again from those inputs with the same weights, RNG state and training
modes, and backward from those output gradients, gives the parameter gradients its backward gave: the
technique activation checkpointing relies on. Where the call's linear layers kept their factors
(`LinearFactors`), `recompute` multiplies those instead of running the block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from infinity.partition.sharded_block import ShardedBlock
from infinity.scheduler.gather_window import Phase
from infinity.scheduler.linear_factors import LinearFactors

# leaves other than tensors a captured call may take: values a later call cannot have changed
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size)


@dataclass
class BlockCall:
    """One captured forward call of a block (see the module docstring)."""

    args: tuple
    kwargs: dict
    versions: list[tuple[torch.Tensor, int]]  # input tensors and their version counters at the call
    rng: torch.Tensor
    device_rng: torch.Tensor | None
    training_pass: int  # the forward pass it was captured in
    buffers: list[tuple[torch.Tensor, int]]  # the block's buffers and their versions when the call began
    modes: list[tuple[nn.Module, bool]]  # each submodule's `training` (a replay in an eval forward trains)
    why_not: str | None = None  # why the call cannot be repeated (None: it can, as far as the capture saw)
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # output leaf index -> its gradient


class BlockInputs:
    """Captures each block's forward call (hooks on the block modules) for `recompute`."""

    def __init__(
        self,
        model: nn.Module,
        blocks: list[ShardedBlock],
        phase: Callable[[], Phase],
        reads_across: Callable[[ShardedBlock], bool],
        device: torch.device,
    ) -> None:
        """`phase`: the scheduler's (captures happen in forward only); `reads_across`: whether a block's
        parameters were read from outside its forward this pass, or it read others' (`BlockScheduler.reads_across`)."""
        self.blocks = blocks
        self._phase = phase
        self._reads_across = reads_across
        self._device = device
        self._calls: dict[int, BlockCall] = {}
        self._seen: set[int] = set()  # blocks called in the running training forward
        self._pass = 0  # training forwards begun
        self._handles = [model.register_forward_pre_hook(self._begin_pass)]
        self.factors = LinearFactors(blocks, self._capturing_call, lambda: self._pass)
        self.factored_blocks = 0  # replays that rebuilt the gradients from kept factors (a counter)
        for block in blocks:
            self._handles.append(block.module.register_forward_pre_hook(self._capture(block), with_kwargs=True))
            self._handles.append(block.module.register_forward_hook(self._watch_outputs(block)))

    def _capturing(self) -> bool:
        return self._phase() is Phase.FORWARD and torch.is_grad_enabled() and not _autocast_on()

    def _capturing_call(self, block: ShardedBlock) -> int | None:
        """The training pass whose call of `block` is being captured now (None if none is)."""
        call = self._calls.get(block.index)
        if not self._capturing() or block.index not in self._seen or call is None or call.why_not is not None:
            return None
        return call.training_pass if call.training_pass == self._pass else None

    def _begin_pass(self, module: nn.Module, args) -> None:
        if self._capturing():
            self._seen.clear()
            self._pass += 1

    def _capture(self, block: ShardedBlock):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._capturing():
                return
            if block.index in self._seen:  # called twice: its gradient is not one call's
                self._calls[block.index].why_not = "it is called more than once in a forward"
                self.factors.drop(block)
                return
            self._seen.add(block.index)
            leaves, _ = tree_flatten((args, kwargs))
            weights = self._gathered_storages()
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            others = sorted({type(x).__name__ for x in leaves if not isinstance(x, (torch.Tensor, *_PLAIN))})
            why_not = f"it is handed objects a call may change ({', '.join(others)})" if others else None
            if any(t.untyped_storage().data_ptr() in weights for t in tensors):
                why_not = "an input is a view of gathered weights"
            args, kwargs = tree_map(_detached, (args, kwargs))
            device_rng = torch.cuda.get_rng_state(self._device) if self._device.type == "cuda" else None
            self._calls[block.index] = BlockCall(
                args,
                kwargs,
                [(t, t._version) for t in tensors],
                torch.get_rng_state(),
                device_rng,
                self._pass,
                [(b, b._version) for b in module.buffers()],
                [(m, m.training) for m in module.modules()],
                why_not,
            )
            self.factors.begin(block, self._pass)

        return hook

    def _gathered_storages(self) -> set[int]:
        """Storages of weights gathered now: an input that is a view of them would change before a replay."""
        return {f.full.untyped_storage().data_ptr() for b in self.blocks for f in b.flats if f.unsharded}

    def _watch_outputs(self, block: ShardedBlock):
        def hook(module: nn.Module, args, output) -> object:
            self.factors.end(block)
            call = self._calls.get(block.index)
            if not self._capturing() or call is None or call.why_not is not None:
                return None
            buffers = [id(b) for b in module.buffers()]  # the call changed the module's state (running statistics)
            if [id(b) for b, _ in call.buffers] != buffers or any(b._version != v for b, v in call.buffers):
                call.why_not = "its forward changes a buffer of the block (running statistics)"
                return None
            # An alias of each output goes on, so that its hook sees the gradient from outside the block only:
            # an output the block also uses itself (T5's position bias) gets the block's own part in its replay.
            leaves, spec = tree_flatten(output)
            aliases = [t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in leaves]
            grads_from_outside = [(i, t) for i, t in enumerate(aliases) if t is not leaves[i]]
            if not grads_from_outside:
                call.why_not = "no output requires a gradient (run without autograd, as reentrant checkpointing does)"
                return None
            for i, t in grads_from_outside:
                t.register_hook(self._keep_grad(call, i))
            return tree_unflatten(aliases, spec)

        return hook

    @staticmethod
    def _keep_grad(call: BlockCall, index: int):
        def hook(grad: torch.Tensor) -> None:
            call.output_grads[index] = grad.detach()

        return hook

    def ready(self, block: ShardedBlock) -> bool:
        """Whether `block`'s gradients, complete now (the last forward's backward ran), can be recomputed by
        `recompute`."""
        call = self._calls.get(block.index)
        return (
            call is not None
            and call.why_not is None
            and call.training_pass == self._pass
            and bool(call.output_grads)
            and all(t._version == v for t, v in call.versions)
            and not self._reads_across(block)
        )

    def from_factors(self, block: ShardedBlock) -> bool:
        """Whether `recompute` will rebuild `block`'s gradients from the factors kept (not run the block again)."""
        call = self._calls.get(block.index)
        return call is not None and call.why_not is None and self.factors.ready(block, call.training_pass)

    def recompute(
        self, block: ShardedBlock, into: Mapping[int, torch.Tensor] | None = None
    ) -> list[torch.Tensor | None]:
        """The gradients of `block.trainable` (None where a parameter got none), rebuilt from the factors kept
        for the captured call, or computed again from the call: the caller has put the weights of that call in
        place and suppressed the hooks (`BlockScheduler.replaying`). Raises if the inputs changed since.
        `into`: trainable index -> memory of the parameter's shape where its rebuilt gradient may be made."""
        call = self._calls.get(block.index)
        if call is None or call.why_not is not None:
            raise RuntimeError(f"block {block.name} has no forward call to recompute its gradient from")
        if self.factors.ready(block, call.training_pass):
            self.factored_blocks += 1
            return self.factors.grads(block, into or {})
        for t, version in call.versions:
            if t._version != version:
                raise RuntimeError(
                    f"an input of block {block.name} was changed in place after its forward: its gradient cannot "
                    "be recomputed; set 'zero_optimization.offload_optimizer.recompute_gradients' to false"
                )
        devices = [self._device] if call.device_rng is not None else []  # none: the CPU generator alone
        modes = [(m, m.training) for m, _ in call.modes]
        try:
            for m, training in call.modes:
                m.training = training
            with _as_captured(), torch.random.fork_rng(devices=devices):
                torch.set_rng_state(call.rng)
                if call.device_rng is not None:
                    torch.cuda.set_rng_state(call.device_rng, self._device)
                output = block.module(*call.args, **call.kwargs)
                leaves = tree_leaves(output)
                outputs = [leaves[i] for i in call.output_grads]
                grads = torch.autograd.grad(
                    outputs, block.trainable, list(call.output_grads.values()), allow_unused=True
                )
        finally:
            for m, training in modes:
                m.training = training
        return list(grads)

    def why_not(self, block: ShardedBlock) -> str | None:
        """Why the block's last captured call cannot be repeated, where the capture found a reason."""
        call = self._calls.get(block.index)
        return call.why_not if call is not None else None

    def holds(self, block: ShardedBlock) -> bool:
        """Whether a captured call of `block` is kept (its inputs and output gradients in memory)."""
        return block.index in self._calls

    def drop(self, block: ShardedBlock) -> None:
        """Forget `block`'s captured call (its gradient was recomputed): its inputs' memory can go."""
        self._calls.pop(block.index, None)
        self.factors.drop(block)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._calls.clear()
        self.factors.remove_hooks()


@contextmanager
def _as_captured() -> Iterator[None]:
    """The autograd context of a captured call, whatever the replay runs inside (the next forward, perhaps
    under no_grad, autocast or a checkpoint's saved-tensor hooks): grad on, no autocast, tensors saved as is."""
    keep = (lambda t: t, lambda t: t)
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autocast("cpu", enabled=False),
        torch.autocast("cuda", enabled=False),
        torch.autograd.graph.saved_tensors_hooks(*keep),
    ):
        yield


def _detached(x: object) -> object:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")
