"""BlockScheduler: module hooks that gather each block just in time, prefetch ahead, and release after.

Forward: a block is gathered in its pre-hook (waiting for its prefetch if one was issued), and the
next blocks of the recorded order are prefetched up to `prefetch_bucket_elems`, never past
`max_live_elems` gathered. After its forward the block is released unless it runs again within
`max_reuse_distance_elems`. Backward: a hook on the block's outputs re-gathers it before its
backward; once all its gradients have accumulated they go to `on_block_grads` and the block is
released. The root's and persistent parameters stay gathered through forward and backward.

With a profiler attached (`prof`, None when off), it records when compute reaches each block and
whether it was ready, stalls and what they waited on, the all-gathers, and each block's compute span.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from infinity.partition.sharded_block import ShardedBlock, ShardSource
from infinity.scheduler.trace import ExecutionTrace


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class BlockScheduler:
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
    ) -> None:
        self.blocks = blocks
        self.root = root
        self.persistent = persistent
        self.source = source
        self.on_block_grads = on_block_grads
        self.prefetch_bucket_elems = prefetch_bucket_elems
        self.max_live_elems = max_live_elems
        self.max_reuse_distance_elems = max_reuse_distance_elems
        self.phase = Phase.IDLE
        self.forward_trace = ExecutionTrace()
        self.backward_trace = ExecutionTrace()
        self.stall_s = 0.0
        self.prefetches_issued = 0
        self.uses = 0  # times compute reached a block
        self.prefetch_hits = 0  # ... and found its weights already there
        self.prof = None  # a TraceWriter when profiling; every use is guarded by `is not None`
        self.gather_waits_on = "all-gather"  # what an unprefetched gather waits for first ("nvme->device", ...)
        self._open_span: tuple[str, int] | None = None
        self._position: dict[int, int | None] = {}
        self._handles = [
            model.register_forward_pre_hook(self._root_pre_forward),
            model.register_forward_hook(self._root_post_forward),
        ]
        for block in blocks:
            self._handles.append(block.module.register_forward_pre_hook(self._pre_forward_hook(block)))
            self._handles.append(block.module.register_forward_hook(self._post_forward_hook(block)))
            for p in block.trainable:
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(block)))

    # -- helpers -------------------------------------------------------------------------------

    def _live_elems(self) -> int:
        return sum(b.numel for b in self.blocks if (b.gathered or b.in_flight) and not b.resident)

    def _ensure_gathered(self, block: ShardedBlock) -> None:
        prof = self.prof
        if block.index >= 0:
            ready = block.gathered or block.ready()
            self.uses += 1
            self.prefetch_hits += ready
            if prof is not None:
                prof.use(block.name, bool(ready))
        if block.gathered:
            return
        in_flight = block.in_flight
        start = time.perf_counter_ns()
        issued = block.issued_ns if in_flight else start
        block.wait_gather(self.source)
        end = time.perf_counter_ns()
        self.stall_s += (end - start) / 1e9
        if prof is not None:
            prof.stall(block.name, start, end, "all-gather" if in_flight else self.gather_waits_on)
            prof.collective("all-gather", block.name, block.gathered_bytes, issued, end)

    def _open(self, block: ShardedBlock) -> None:
        """A block's compute starts now: the previous one's span (if still open) ends here."""
        if self.prof is not None:
            self._close()
            self._open_span = (block.name, time.perf_counter_ns())

    def _close(self) -> None:
        if self.prof is not None and self._open_span is not None:
            name, start = self._open_span
            self.prof.compute(name, start, time.perf_counter_ns())
            self._open_span = None

    def _prefetch(self, upcoming: list[int]) -> None:
        """All-gather the next blocks within the bucket; read the blocks beyond it ahead into host memory.

        Which blocks are all-gathered depends only on the trace and the limits, never on timing (such
        as whether a read has finished), so every rank issues its collectives in the same order.
        """
        budget = self.prefetch_bucket_elems
        live = self._live_elems()
        beyond: list[int] = []
        for position, index in enumerate(upcoming):
            block = self.blocks[index]
            if block.gathered or block.in_flight:
                continue
            # as in DeepSpeed, a non-zero bucket always takes the next block, even one larger than the bucket
            first = 0 < budget == self.prefetch_bucket_elems
            if (block.numel > budget and not first) or live + block.numel > self.max_live_elems:
                beyond = upcoming[position:]
                break
            block.start_gather(self.source)
            self.prefetches_issued += 1
            if self.prof is not None:
                self.prof.prefetch(block.name)
            budget = max(0, budget - block.numel)
            live += block.numel
        ahead = dict.fromkeys(i for i in beyond if not (self.blocks[i].gathered or self.blocks[i].in_flight))
        if ahead:
            self.source.prefetch_to_host([f for i in ahead for f in self.blocks[i].flats])

    def release_all(self) -> None:
        """Release every gathered block but the persistent one (end of a step or of inference)."""
        for block in [*self.blocks, self.root]:
            if block.in_flight:
                block.wait_gather(self.source)
            block.release()

    # -- forward -------------------------------------------------------------------------------

    def _root_pre_forward(self, module: nn.Module, args) -> None:
        if self.phase is Phase.BACKWARD:
            return
        self.phase = Phase.FORWARD
        self.forward_trace.start_pass()
        self._ensure_gathered(self.persistent)
        self._ensure_gathered(self.root)

    def _root_post_forward(self, module: nn.Module, args, output) -> None:
        if self.phase is not Phase.FORWARD:
            return
        self.forward_trace.end_pass()
        self.phase = Phase.IDLE
        if not torch.is_grad_enabled():
            self.release_all()

    def _pre_forward_hook(self, block: ShardedBlock):
        def hook(module: nn.Module, args) -> None:
            if self.phase is Phase.BACKWARD:  # activation checkpointing recomputes inside backward
                self._ensure_gathered(block)
                return
            position = self.forward_trace.visit(block.index)
            self._position[block.index] = position
            self._close()
            self._ensure_gathered(block)
            if position is not None:
                self._prefetch(self.forward_trace.upcoming(position))
            self._open(block)

        return hook

    def _post_forward_hook(self, block: ShardedBlock):
        def hook(module: nn.Module, args, output):
            if self.phase is Phase.BACKWARD:
                return output
            self._close()
            if torch.is_grad_enabled():
                outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
                if outputs:
                    torch.autograd.graph.register_multi_grad_hook(outputs, self._pre_backward_hook(block), mode="any")
            position = self._position.get(block.index)
            if position is not None:
                distance = self.forward_trace.next_use_distance(position, block.index, lambda i: self.blocks[i].numel)
                if distance is not None and distance <= self.max_reuse_distance_elems:
                    return output
            block.release()
            return output

        return hook

    # -- backward ------------------------------------------------------------------------------

    def begin_backward(self) -> None:
        """Called before autograd runs: recomputation (checkpointing) inside it is not a forward pass."""
        self.phase = Phase.BACKWARD
        self.backward_trace.start_pass()

    def _pre_backward_hook(self, block: ShardedBlock):
        def hook(grad) -> None:
            if self.phase is not Phase.BACKWARD:  # loss.backward() called directly, not engine.backward
                self.begin_backward()
            position = self.backward_trace.visit(block.index)
            self._close()
            self._ensure_gathered(block)
            if position is not None:
                self._prefetch(self.backward_trace.upcoming(position))
            self._open(block)

        return hook

    def _grad_hook(self, block: ShardedBlock):
        def hook(param: torch.Tensor) -> None:
            block.grads_ready += 1
            if block.grads_ready == len(block.trainable):
                block.grads_ready = 0
                self.on_block_grads(block)
                block.release()

        return hook

    def finish_backward(self) -> None:
        """Hand over the gradients not yet reduced (root, persistent, unused parameters); release blocks."""
        self._close()
        self.backward_trace.end_pass()
        for block in [*self.blocks, self.root, self.persistent]:
            if block.grads_ready or block in (self.root, self.persistent):
                block.grads_ready = 0
                self.on_block_grads(block)
        self.release_all()
        self.phase = Phase.IDLE

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
