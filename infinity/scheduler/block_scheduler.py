"""BlockScheduler: module hooks that gather each block just in time, prefetch ahead, and reshard after.

Forward: a block is gathered in its pre-hook (waiting for its prefetch if one was issued), and the
next blocks of the recorded order are prefetched up to `prefetch_bucket_elems`, never past
`max_live_elems` gathered. After its forward the block is resharded unless it runs again within
`max_reuse_distance_elems`, or unless backward's first prefetch would gather it again (`backward_turn`).
Backward: a hook on the block's outputs re-gathers it before its backward; once all its gradients have
accumulated they go to `on_block_grads` and the block is resharded. The root's and persistent
parameters stay gathered through forward and backward.

A block's parameter read from outside the block (`param_access`) gathers the block then and there
and enters the trace at that point, so the next step prefetches it. Read by a block, it is released
when the reader's forward ends and gathered again before the reader's backward; read by the root
with autograd on, it stays gathered until its gradients are complete. Either way it adds its
gathered weights to the working set while its reader runs.

Gathering, its order on every rank and the prefetch bucket: `gather_window`.

It records into `prof` (a `TraceWriter`, or a `NullTraceWriter` when profiling is off) when compute
reaches each block and whether it was ready, stalls and what they waited on, the all-gathers (with
several ranks), and each block's compute span.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from infinity.partition.sharded_block import ShardedBlock, ShardSource
from infinity.scheduler.backward_turn import kept_for_backward
from infinity.scheduler.gather_window import GatherWindow, Phase
from infinity.scheduler.input_grads import InputGrads
from infinity.scheduler.param_access import ExternalReads, install_param_access
from infinity.scheduler.trace import ExecutionTrace


class BlockScheduler(GatherWindow):
    """Owns the hooks on the model; the engine calls `finish_backward` after each backward."""

    def __init__(
        self,
        model: nn.Module,
        blocks: list[ShardedBlock],
        root: ShardedBlock,
        persistent: ShardedBlock,
        source: ShardSource,
        on_block_grads: Callable[[ShardedBlock], None],
        prefetch_bucket_elems: int,
        max_live_elems: int,
        max_reuse_distance_elems: int,
        gather_waits_on: str = "all-gather",
        collectives: bool = True,
        prof=None,
    ) -> None:
        """`gather_waits_on` labels the stall of a gather nobody prefetched (what it waits for first);
        `collectives` is False where gathers are local copies (one rank): no all-gather is recorded."""
        super().__init__(blocks, source, prefetch_bucket_elems, max_live_elems, gather_waits_on, collectives, prof)
        self.root = root
        self.persistent = persistent
        self.on_block_grads = on_block_grads
        self.max_reuse_distance_elems = max_reuse_distance_elems
        self.forward_trace = ExecutionTrace()
        self.backward_trace = ExecutionTrace()
        self._open_span: tuple[str, int] | None = None
        self._position: dict[int, int | None] = {}
        self._running: list[ShardedBlock] = []  # the root and the blocks whose forward is running, outermost first
        self._kept_for_backward: set[int] = set()  # blocks this forward leaves gathered for backward
        self._external = ExternalReads()
        # the blocks that read across in the pass backward just finished: `reshard_all` clears the record for the
        # step, while reductions may still land (and ask `reads_across`) until the next forward
        self._read_across_last_pass: frozenset[ShardedBlock] = frozenset()
        self._remove_param_access = install_param_access([*blocks, root, persistent], self._on_param_read)
        self._input_grads = InputGrads(self._inputs_done)
        self._grads_in: set[ShardedBlock] = set()  # their gradients are in; backward may still read frozen weights
        self._watched: set[ShardedBlock] = set()  # blocks whose calls this pass's forward watched
        self._inputs_watched: set[ShardedBlock] = set()  # ... of which some call's inputs require grad
        self._handles = [
            model.register_forward_pre_hook(self._root_pre_forward),
            model.register_forward_hook(self._root_post_forward),
            model.register_state_dict_pre_hook(self._before_state_dict),
        ]
        for block in blocks:
            self._handles.append(block.module.register_forward_pre_hook(self._pre_forward_hook(block)))
            self._handles.append(block.module.register_forward_hook(self._post_forward_hook(block)))
            for p in block.trainable:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(block)))
            hook = self._watch_input_grads(block)
            self._handles.append(block.module.register_forward_pre_hook(hook, with_kwargs=True))
        for block in (root, persistent):
            owners = {module for flat in block.flats for slot in flat.slots for module, _ in slot.uses}
            for module in owners - {model}:
                self._handles.append(module.register_forward_pre_hook(self._gather_for_direct_call(block)))

    # -- between steps ---------------------------------------------------------------------------

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """`model.state_dict()` between steps reads the resident weights: they must have arrived."""
        for block in (self.persistent, self.root, *self.blocks):
            if block.resident:
                self._settle_resident(block, stall=False)

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """A block's forward and backward run again to recompute its gradient (`BlockInputs.recompute`): the
        hooks gather, record and reduce nothing meanwhile; the phase before is restored after."""
        phase, self.phase = self.phase, Phase.REPLAY
        try:
            yield
        finally:
            self.phase = phase

    def issue_queued_gathers(self) -> None:
        """Issue every queued gather now: another collective follows (see `GatherWindow._issue_all`)."""
        self._issue_all()

    def reads_across(self, block: ShardedBlock) -> bool:
        """In this pass, `block`'s parameters were read from outside its forward, or its forward read the
        parameters of another block or of the root (`param_access`); after backward, in the pass it ended."""
        return block in self._read_across_last_pass or self._reads_across_now(block)

    def _reads_across_now(self, block: ShardedBlock) -> bool:
        return (
            self._external.was_read(block)
            or bool(self._external.read_by(block))
            or block in self._external.root_readers
        )

    def _open(self, block: ShardedBlock) -> None:
        """A block's compute starts now: the previous one's span (if still open) ends here."""
        self._close()
        self.prof.open_span("compute")
        self._open_span = (block.name, time.perf_counter_ns())

    def _close(self) -> None:
        if self._open_span is not None:
            name, start = self._open_span
            self.prof.close_span("compute")
            self.prof.compute(name, start, time.perf_counter_ns())
            self._open_span = None

    def reshard_all(self) -> None:
        """Reshard every gathered block but the persistent one (end of a step or of inference)."""
        self._external.clear()
        for block in [*self.blocks, self.root]:
            if block.in_flight:
                self._issue_through(block)
                block.wait_unshard(self.source)
            block.reshard()

    def _gather_for_direct_call(self, block: ShardedBlock):
        """A module owning root or persistent parameters called with no pass running (an encoder that
        generate() calls directly, input embeddings made before the engine's forward): gather them, as
        the root's forward would; resharded when the pass after ends. Called on every rank, as DeepSpeed
        requires of ZeRO-3 inference; a read by attribute alone between steps still sees what is there."""

        def hook(module: nn.Module, args) -> None:
            if self.phase is Phase.IDLE and not block.unsharded:
                self._ensure_gathered(block)

        return hook

    # -- forward -------------------------------------------------------------------------------

    def _root_pre_forward(self, module: nn.Module, args) -> None:
        if self.phase in (Phase.BACKWARD, Phase.REPLAY):
            return
        self.phase = Phase.FORWARD
        self._running = [self.root]
        for flat in (f for b in (self.persistent, self.root, *self.blocks) if b.resident for f in b.flats):
            flat.restore_resident_views()  # where the model replaced their data (cast its own weights)
        if torch.is_grad_enabled():
            self._read_across_last_pass = frozenset()
            self._watched.clear()  # this forward's calls, not an earlier forward's that had no backward
            self._inputs_watched.clear()
        self._external.begin_call(self.root)
        self.forward_trace.start_pass()
        self._kept_for_backward = self._plan_backward_turn() if torch.is_grad_enabled() else set()
        self._ensure_gathered(self.persistent)
        self._ensure_gathered(self.root)

    def _plan_backward_turn(self) -> set[int]:
        """The blocks to leave gathered at the end of their forward (`backward_turn`), from the last orders."""
        if not (self.forward_trace.valid and self.backward_trace.valid):
            return set()
        return kept_for_backward(
            self.forward_trace.order,
            self.backward_trace.order,
            lambda i: self.blocks[i].numel,
            self.prefetch_bucket_elems,
            self.max_live_elems,
            self.max_reuse_distance_elems,
        )

    def _root_post_forward(self, module: nn.Module, args, output) -> None:
        if self.phase is not Phase.FORWARD:
            return
        self.forward_trace.end_pass()
        self.phase = Phase.IDLE
        self._running = []
        self._external.end_call(self.root)  # what the root read stays gathered (held_for_step) or is resharded now
        if not torch.is_grad_enabled():
            self.reshard_all()

    def _pre_forward_hook(self, block: ShardedBlock):
        def hook(module: nn.Module, args) -> None:
            if self.phase is Phase.REPLAY:
                return
            if self.phase is Phase.BACKWARD:  # activation checkpointing recomputes inside backward
                self._ensure_gathered(block)
                return
            position = self.forward_trace.visit(block.index)
            self._position[block.index] = position
            self._close()
            self._ensure_gathered(block)
            if position is not None:
                self._prefetch(self.forward_trace.upcoming(position), block.index)
            self._running.append(block)
            self._external.begin_call(block)
            self._open(block)

        return hook

    def _post_forward_hook(self, block: ShardedBlock):
        def hook(module: nn.Module, args, output):
            if self.phase in (Phase.BACKWARD, Phase.REPLAY):
                return output
            self._close()
            if torch.is_grad_enabled():
                outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
                if outputs:
                    torch.autograd.graph.register_multi_grad_hook(outputs, self._pre_backward_hook(block), mode="any")
            if self._running and self._running[-1] is block:
                self._running.pop()
            for read in self._external.end_call(block):
                self._release_after_use(read)
            self._release_after_use(block)
            return output

        return hook

    def _release_after_use(self, block: ShardedBlock) -> None:
        """Reshard `block` after a forward use unless it runs again soon, is still running, or is held."""
        if block in self._running or block in self._external.held_for_step:
            return
        position = self._position.get(block.index)
        if position is not None:
            distance = self.forward_trace.next_use_distance(position, block.index, lambda i: self.blocks[i].numel)
            if distance is not None and distance <= self.max_reuse_distance_elems:
                return
            if distance is None and block.index in self._kept_for_backward:  # its last forward use
                return
        block.reshard()

    # -- parameters read outside their block -----------------------------------------------------

    def _on_param_read(self, block: ShardedBlock) -> None:
        """A parameter of `block` was read by name (`param_access`): gather the block if the read comes from
        outside it. Only forward and backward gather; reads between steps see what is there (resident
        weights once they have arrived)."""
        if self.phase is Phase.REPLAY:  # the replay put the weights it reads in place itself
            return
        if block.resident:
            self._settle_resident(block, stall=self.phase is not Phase.IDLE)
        if block is self.root or block is self.persistent:  # gathered for the whole pass: nothing to do
            reader = self._running[-1] if self._running else None
            if block is self.root and self.phase is Phase.FORWARD and reader not in (None, self.root):
                self._external.root_readers.add(reader)
            return
        if self.phase is Phase.IDLE or block in self._running:
            return
        if self.phase is Phase.BACKWARD:  # recomputation inside backward: held until its gradients are complete
            if not block.unsharded:
                self._ensure_gathered(block)
            return
        reader = self._running[-1] if self._running else self.root
        if not self._external.note(reader, block):  # read again in the same call
            if not block.unsharded:
                self._ensure_gathered(block)
            return
        position = self.forward_trace.visit(block.index)
        self._position[block.index] = position
        self._ensure_gathered(block)
        if position is not None:
            self._prefetch(self.forward_trace.upcoming(position), block.index)
        if reader is self.root and torch.is_grad_enabled():
            self._external.held_for_step.add(block)

    # -- backward ------------------------------------------------------------------------------

    def begin_backward(self) -> None:
        """Called before autograd runs: recomputation (checkpointing) inside it is not a forward pass."""
        self.phase = Phase.BACKWARD
        self.backward_trace.start_pass()
        for block in self._external.held_for_step:  # the root's first backward nodes may need them
            if not block.unsharded:
                self._ensure_gathered(block)

    def _pre_backward_hook(self, block: ShardedBlock):
        def hook(grad) -> None:
            if self.phase is not Phase.BACKWARD:  # loss.backward() called directly, not engine.backward
                self.begin_backward()
            position = self.backward_trace.visit(block.index)
            self._close()
            self._ensure_gathered(block)
            if position is not None:
                self._prefetch(self.backward_trace.upcoming(position), block.index)
            for read in self._external.read_by(block):  # its backward reads them: held until their grads are done
                self.backward_trace.visit(read.index)
                if not read.unsharded:
                    self._ensure_gathered(read)
            self._open(block)

        return hook

    def _grad_hook(self, block: ShardedBlock):
        def hook(param: torch.Tensor) -> None:
            if self.phase is Phase.REPLAY:  # a replay's gradients are not backward's (autograd.grad stores none)
                return
            block.grads_ready += 1
            # this count falls short on a rank where some parameter got no gradient: the block's inputs'
            # gradients say when it is done instead where they are watched (`_ends_with_inputs`)
            if block.grads_ready == len(block.trainable) and not self._ends_with_inputs(block):
                self._block_grads_done(block)

        return hook

    def _block_grads_done(self, block: ShardedBlock) -> None:
        """Hand `block`'s gradients over (this rank's: a parameter may have none) and reshard it."""
        block.grads_ready = 0
        self._issue_all()  # the reduction's collectives come after every gather issued so far
        self.on_block_grads(block)
        self._external.held_for_step.discard(block)
        if self._input_grads.owes(block):  # its inputs' gradients still read its frozen weights
            self._grads_in.add(block)
        else:
            block.reshard()

    def _watch_input_grads(self, block: ShardedBlock):
        """Watch a training call's inputs (`InputGrads`): in forward, or in the recomputation of a reentrant
        checkpoint, whose forward ran without grad (a non-reentrant one's forward was watched already)."""

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not torch.is_grad_enabled():
                return None
            if self.phase is Phase.FORWARD:
                self._watched.add(block)
            elif self.phase is not Phase.BACKWARD or block in self._watched:
                return None
            watched = self._input_grads.watch(block, args, kwargs)
            if watched is not None:
                self._inputs_watched.add(block)
            return watched

        return hook

    def _ends_with_inputs(self, block: ShardedBlock) -> bool:
        """`block`'s gradients go when backward has made its inputs' gradients (`_inputs_done`); not where another
        block read its weights: that reader's backward may add to their gradients after this block's is over."""
        return block in self._inputs_watched and not self._external.was_read(block)

    def _inputs_done(self, block: ShardedBlock) -> None:
        """Backward is done with `block`: its gradients go (every rank's, in the same order), and it is resharded
        if they are in (or it has none)."""
        if block.trainable and self._ends_with_inputs(block) and block not in self._grads_in:
            self._block_grads_done(block)
            return
        if block in self._grads_in or not block.trainable:
            self._grads_in.discard(block)
            # a block gathered again meanwhile (the backward order's prefetch) is left to `finish_backward`
            if block not in self._external.held_for_step and not block.in_flight:
                block.reshard()

    def finish_backward(self) -> None:
        """Hand over the gradients not yet reduced (root, persistent, unused parameters); release blocks."""
        self._close()
        self.backward_trace.end_pass()
        self._input_grads.clear()
        self._grads_in.clear()
        self._watched.clear()
        self._inputs_watched.clear()
        self._issue_all()
        for block in [*self.blocks, self.root, self.persistent]:
            if block.grads_ready or block in (self.root, self.persistent):
                block.grads_ready = 0
                self.on_block_grads(block)
        self._read_across_last_pass = frozenset(b for b in self.blocks if self._reads_across_now(b))
        self.reshard_all()
        self.phase = Phase.IDLE

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._remove_param_access()
