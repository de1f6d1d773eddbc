"""GradientReplay: a block's gradients recomputed when its deferred step runs, instead of kept until then.

Where the NVMe optimizer's step waits for the global gradient norm (clipping, fp16's overflow check) or a
client optimizer's hyper-parameters, it is deferred into the next forward, and every gradient waits for it:
under a host budget on NVMe, written in backward and read back by the step (8 bytes per fp32 parameter).
Instead, backward keeps each block's gradient norm only (`ShardStore`, once a trial step found the recomputed
gradients equal to backward's), and `BlockInputs` keeps what the block's forward was given and what its
outputs' gradient was. When the step reaches the block, its forward and backward run again from those, on the
weights of the step before (the shards the step is about to update), and the gradients are reduced and handed
to the shard store as backward handed them: the same bytes, verified against the norm backward gave. One more
forward and backward of each block replaces the disk's round trip, where the disk, not the compute, sets the
step time; where a micro-batch has few tokens for the block's width, one product per linear weight from the
factors backward kept (`LinearFactors`) replaces even that.

It applies with one micro-batch per step and where the gradients would wait on NVMe (`recompute_gradients`).
A block's forward may read the persistent parameters (small ones, gathered for the whole pass), which the
step updates before any block: their weights as backward saw them are copied when the step is deferred
(`keep_persistent_weights`, a few bytes per block) and put in place for each replay. A block whose module
holds parameters of another kind (another block's, the root's), or whose call cannot be replayed
(`BlockInputs.ready`), sends its gradients the usual way.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from infinity.config import InfinityConfig
from infinity.engine.grad_reduction import GradReducer
from infinity.optim.sharded_adam import ShardedAdam
from infinity.partition import FlatParam
from infinity.partition.sharded_block import ShardedBlock
from infinity.scheduler import BlockScheduler
from infinity.scheduler.block_inputs import BlockInputs
from infinity.shards import ShardStore
from infinity.shards.policy import Placement, StepTiming
from infinity.storage import Tier


def recompute_gradients(cfg: InfinityConfig, placement: Placement, grads_in_host: bool) -> bool:
    """Whether gradients are recomputed for their step: `offload_optimizer.recompute_gradients` is on, the NVMe
    optimizer's step is deferred into the next forward, its gradients would wait on NVMe (not in host memory)
    and each step takes one micro-batch (a replay recomputes one forward's gradient)."""
    return (
        cfg.zero_optimization.offload_optimizer.recompute_gradients
        and placement.optim_home is Tier.NVME
        and placement.step_timing is StepTiming.BEFORE_NEXT_GATHER
        and not grads_in_host
        and cfg.gradient_accumulation_steps == 1
    )


class GradientReplay:
    """The shard store's `GradReplay`: see the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        blocks: list[ShardedBlock],
        persistent: ShardedBlock,
        scheduler: BlockScheduler,
        reducer: GradReducer,
        optimizer: ShardedAdam,
        shards: ShardStore,
        prof,
    ) -> None:
        device = shards.placement.compute_device
        self.inputs = BlockInputs(model, blocks, lambda: scheduler.phase, scheduler.reads_across, device)
        self.scheduler = scheduler
        self.reducer = reducer
        self.optimizer = optimizer
        self.shards = shards
        self.prof = prof
        self.persistent = persistent
        self._blocks = blocks
        self._block_of: dict[FlatParam, ShardedBlock] = {f: b for b in blocks for f in b.flats}
        persistent_ids = {id(p) for f in persistent.flats for p in f.params}
        self._self_contained = {  # its module holds its own flats' parameters and persistent ones, nothing else
            b.index
            for b in blocks
            if {id(p) for p in b.module.parameters()} <= persistent_ids | {id(p) for f in b.flats for p in f.params}
        }
        self._persistent_weights: dict[FlatParam, torch.Tensor] = {}
        self.rejected: dict[str, str] = {}  # blocks whose trial failed (`reject`), by name: why
        self.replayed_blocks = 0  # blocks whose gradients were recomputed (a counter)
        self._noticed: set[str] = set()

    def accepts(self, flat: FlatParam) -> bool:
        block = self._block_of.get(flat)
        if block is None:
            return False
        if block.index in self._self_contained and block.name not in self.rejected and self.inputs.ready(block):
            return True
        self._notice(block)
        self.inputs.drop(block)  # its gradient waits on NVMe: the inputs and output gradients kept for it can go
        return False

    def reject(self, flat: FlatParam, why: str) -> None:
        block = self._block_of[flat]
        self.rejected.setdefault(block.name, why)
        self._notice(block)

    def _notice(self, block: ShardedBlock) -> None:
        """Say once per reason (rank 0) why blocks' gradients wait on NVMe instead of being recomputed."""
        why = self.inputs.why_not(block)
        if block.index not in self._self_contained:
            why = "its module holds parameters of another block or of the root"
        if block.name in self.rejected:
            why = self.rejected[block.name]
        if why is None or why in self._noticed:
            return
        self._noticed.add(why)
        if self.shards.comm.rank == 0:
            print(
                f"infinity: the gradients of {block.name} (and of blocks like it) wait on NVMe for the step, not "
                f"recomputed (offload_optimizer.recompute_gradients): {why}",
                file=sys.stderr,
            )

    def keep_persistent_weights(self) -> None:
        """The step is about to be deferred: copy the persistent parameters' weights (gathered since the forward)
        for the replays, which run after the step has updated them."""
        self._persistent_weights = {f: f.full.clone() for f in self.persistent.flats if f.unsharded}

    def replay(self, flat: FlatParam) -> None:
        """Gather `flat`'s block with the weights its owed step starts from, run its forward and backward again
        and hand its gradients over (to `ShardStore.accumulate_grad`, which holds them for the step)."""
        block = self._block_of[flat]
        start = time.perf_counter_ns()
        if self.shards.comm.world_size > 1:  # this replay's collectives come after them on every rank
            self.scheduler.issue_queued_gathers()
        fetched: list[FlatParam] = []
        gathered: list[FlatParam] = []
        following = self.scheduler.forward_trace.after(block.index)  # the next block the forward runs
        after = self._blocks[following].flats if following is not None else []
        self.shards.prefetch_unsettled(*([f for f in fs if not f.unsharded] for fs in (block.flats, after)))
        try:
            for f in block.flats:
                if f.unsharded:  # resident: its buffer holds the weights until the step writes them
                    continue
                shard = self.shards.fetch_unsettled_param(f)
                fetched.append(f)
                if shard.numel() == f.padded_numel and shard.device == f.full.device:
                    f.install_views(shard)  # one rank: the shard is the whole flat, read where it is
                else:
                    f.unshard(shard)
                gathered.append(f)
            buffers = self._grad_buffers(block)
            with self.scheduler.replaying(), self._persistent_in_place():
                grads = self.inputs.recompute(block, _views(block, buffers))
            for p, g in zip(block.trainable, grads, strict=True):
                p.grad = g
            with self.optimizer.replaying():
                self.reducer.reduce_block(block, final=True, buffers=buffers)
                self.reducer.flush()
        finally:
            for p in block.trainable:
                p.grad = None
            for f in gathered:
                if f.unsharded:
                    f.reshard()
                else:
                    f.clear_views()
            for f in fetched:
                self.shards.release_unsettled_param(f)
        self.inputs.drop(block)
        self.replayed_blocks += 1
        if not self.shards.replays_owed():  # the last one: the copies can go
            self._persistent_weights = {}
        self.prof.compute(f"{block.name} (gradient replay)", start, time.perf_counter_ns())

    def _grad_buffers(self, block: ShardedBlock) -> dict[FlatParam, torch.Tensor]:
        """Where a replay from factors makes the gradients: the memory the reducer hands them over in, taken
        ahead, where it is in the compute's dtype and memory (a rerun's backward makes its own, as do products
        in another dtype: the buffers would only add to the peak)."""
        if not self.inputs.from_factors(block):
            return {}
        taken = {
            f: self.reducer.grad_buffer(f)
            for f in block.flats
            if f.requires_grad and self.shards.expects_replayed_grad(f)
        }
        return {
            f: buffer
            for f, buffer in taken.items()
            if buffer is not None and buffer.dtype == f.full.dtype and buffer.device == f.full.device
        }

    def remove_hooks(self) -> None:
        self.inputs.remove_hooks()

    @contextmanager
    def _persistent_in_place(self) -> Iterator[None]:
        """The persistent parameters point at the weights kept for the replays meanwhile."""
        flats = [f for f in self.persistent.flats if f.params]
        missing = [f.name for f in flats if f not in self._persistent_weights]
        if missing:
            raise RuntimeError(f"no weights were kept for the replay of persistent parameters {missing}")
        now = [[p.data for p in f.params] for f in flats]
        try:
            for f in flats:
                f.install_views(self._persistent_weights[f])
            yield
        finally:
            for f, data in zip(flats, now, strict=True):
                for p, d in zip(f.params, data, strict=True):
                    p.data = d


def _views(block: ShardedBlock, buffers: dict[FlatParam, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Trainable index -> its parameter's piece of its flat's buffer, in the parameter's shape."""
    index = {id(p): i for i, p in enumerate(block.trainable)}
    views = {}
    for flat, buffer in buffers.items():
        for p, view in zip(flat.params, flat.unflatten(buffer).values(), strict=True):
            if id(p) in index:
                views[index[id(p)]] = view
    return views
