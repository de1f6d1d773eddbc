"""Gradients of one block, from its parameters to this rank's optimizer shards."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from infinity.comm import CommGroup
from infinity.optim.sharded_adam import ShardedAdam
from infinity.partition import FlatParam
from infinity.partition.sharded_block import ShardedBlock
from infinity.shards import GradReduction
from infinity.shards.grad_presence import ones_where


@dataclass
class _InFlight:
    """A reduction issued and not yet handed to the optimizer."""

    flat: FlatParam
    block: str
    shard: torch.Tensor  # this rank's slice of the sum (a view of `full` for an all-reduce)
    full: torch.Tensor  # the input: kept alive until the collective is done
    work: object | None
    final: bool
    start_ns: int
    # stepped as it arrives: per parameter, 1 where some rank's gradient had it (the block's flats share one
    # all-reduce, `_presence`)
    presence: torch.Tensor | None = None
    presence_work: object | None = None

    def arrived(self) -> bool:
        return (self.work is None or self.work.is_completed()) and (
            self.presence_work is None or self.presence_work.is_completed()
        )


@dataclass(frozen=True)
class GradScaling:
    """Where the division by the world size happens around the sum over ranks (DeepSpeed's
    `prescale_gradients` and `gradient_predivide_factor`, as its engine's all-reduce applies them): prescaled,
    all of it before; otherwise by the predivide factor before and by world size / factor after. The result
    is the mean either way; pre-dividing keeps large sums in range."""

    before: float  # divisor applied to this rank's gradients before the sum
    after: float  # divisor applied to the sum

    @staticmethod
    def from_config(prescale: bool, predivide_factor: float, world_size: int) -> GradScaling:
        if prescale:
            return GradScaling(float(world_size), 1.0)
        return GradScaling(predivide_factor, world_size / predivide_factor)


class GradReducer:
    """Reduces each block's gradients into this rank's optimizer shards as its backward ends.

    Gradients cross ranks in `reduce_dtype` (`communication_data_type`; the compute dtype by default, as
    DeepSpeed), and the optimizer sums them in fp32. Stages 2-3 reduce-scatter; stage 1 all-reduces and
    keeps this rank's slice (twice the bytes of a reduce-scatter for the same result: stage 2 is the better
    choice where a config allows it). Both reduce every micro-batch, so micro-batches are summed in the
    order plain PyTorch sums them. With `overlap` (`overlap_comm`) the collectives run while backward goes
    on: each is handed over as soon as it has arrived, and no more than `bucket_elems`
    (`reduce_bucket_size`) elements wait at once; `flush()` ends them. With one
    rank the gradients are this rank's shard already: the one place that knows it, so they go to the
    accumulator in one pass. `scaling` places the division by the world size around the sum (DeepSpeed's
    prescale_gradients / gradient_predivide_factor)."""

    def __init__(
        self,
        comm: CommGroup,
        optimizer: ShardedAdam,
        reduction: GradReduction,
        reduce_dtype: torch.dtype,
        overlap: bool,
        bucket_elems: int,
        prof,
        scaling: GradScaling | None = None,
    ) -> None:
        self.comm = comm
        self.optimizer = optimizer
        self.reduction = reduction
        self.reduce_dtype = reduce_dtype
        self.overlap = overlap
        self.bucket_elems = bucket_elems
        self.prof = prof
        self.scaling = scaling or GradScaling(1.0, float(comm.world_size))
        self._in_flight: deque[_InFlight] = deque()
        self._in_flight_elems = 0

    def grad_buffer(self, flat: FlatParam) -> torch.Tensor | None:
        """The padded flat `reduce_block` will hand `flat`'s gradients over in (the reduction's input, or one
        rank's copy for the optimizer), for a caller that makes them there itself; None where there is none."""
        if self.comm.world_size == 1:
            return self.optimizer.local_grad_buffer(flat)
        return self.comm.buffers.take(flat.padded_numel, self.reduce_dtype, flat.full.device)

    def reduce_block(
        self, block: ShardedBlock, final: bool, buffers: dict[FlatParam, torch.Tensor] | None = None
    ) -> None:
        """Hand the block's gradients over and free them; `final` marks the last micro-batch before a step.
        `buffers`: flats' `grad_buffer`s, taken ahead, that hold some of their gradients already (as views)."""
        trainable = [flat for flat in block.flats if flat.requires_grad]
        buffers = buffers or {}
        presence = self._presence(block.name, trainable, final)
        if self.comm.world_size == 1:
            for flat in trainable:
                self.optimizer.accumulate_local_grads(flat, final, buffers.get(flat))
                flat.clear_grads()
            return
        for flat, present in zip(trainable, presence, strict=True):
            self._issue(block.name, flat, final, present, buffers.get(flat))
            flat.clear_grads()
            # hand over what has arrived (its buffers go at once); wait only past the bucket
            while self._in_flight and (
                not self.overlap or self._in_flight_elems > self.bucket_elems or self._in_flight[0].arrived()
            ):
                self._complete_oldest()

    def flush(self) -> None:
        """Wait for every reduction in flight and hand its gradients to the optimizer."""
        while self._in_flight:
            self._complete_oldest()

    def _issue(
        self,
        block_name: str,
        flat: FlatParam,
        final: bool,
        present: tuple[torch.Tensor, object] | None,
        full: torch.Tensor | None,
    ) -> None:
        device = flat.full.device
        if full is None:
            full = self.grad_buffer(flat)
        if flat.flat_grad(full) is None:  # every rank joins the collective, with or without gradients
            full.zero_()
        if self.scaling.before != 1.0:
            full.div_(self.scaling.before)
        start = time.perf_counter_ns()
        what = f"gradients of {flat.name}"
        if self.reduction is GradReduction.REDUCE_SCATTER and self.overlap:
            shard, work = self.comm.reduce_scatter_in_background(full, what)
        elif self.reduction is GradReduction.REDUCE_SCATTER:
            shard = torch.empty(flat.shard_numel, dtype=self.reduce_dtype, device=device)
            work = self.comm.reduce_scatter_sum(shard, full, what)
        else:
            begin, end = flat.shard_range
            work = None
            if self.overlap:
                work = self.comm.all_reduce(full, what, async_op=True)
            else:
                self.comm.all_reduce(full, what)
            shard = full[begin:end]
        job = _InFlight(flat, block_name, shard, full, work, final, start, *(present or (None, None)))
        self._in_flight.append(job)
        self._in_flight_elems += full.numel()

    def _presence(
        self, block_name: str, flats: list[FlatParam], final: bool
    ) -> list[tuple[torch.Tensor, object] | None]:
        """Note which of each flat's parameters got a gradient on this rank (the step skips those that got none
        on any, `optim.param_steps`). Where flats step as their gradients arrive, the ranks agree on it with the
        final micro-batch's reduction, in one all-reduce for the block's flats issued before their reductions:
        (1 where some rank had it, its work) per flat. Otherwise they agree once, before the step."""
        for flat in flats:
            self.optimizer.note_grad_presence(flat, flat.grad_presence())
        if not (final and flats and self.optimizer.step_in_backward and self.comm.world_size > 1):
            return [None] * len(flats)
        shards = self.optimizer.shards
        mine = [list(shards.grad_presence(flat) or (True,) * len(flat.slots)) for flat in flats]
        both = ones_where([v for present in mine for v in present], self.comm.device)
        work = self.comm.all_reduce(both, f"which parameters of {block_name} got gradients", op="max", async_op=True)
        return [(view, work) for view in both.split([len(present) for present in mine])]

    def _complete_oldest(self) -> None:
        job = self._in_flight.popleft()
        self._in_flight_elems -= job.full.numel()
        if job.work is not None:
            start = time.perf_counter_ns()
            job.work.wait()  # on the slowest rank's arrival: a stall (inside a block's span it is carved out of it)
            self.prof.stall(job.block, start, time.perf_counter_ns(), self.reduction.value)
        nbytes = job.full.numel() * job.full.element_size()
        self.prof.collective(self.reduction.value, job.block, nbytes, job.start_ns, time.perf_counter_ns())
        if job.presence_work is not None:
            job.presence_work.wait()  # (on a device: its stream waits; the values are read as the gradient arrives)
        if self.scaling.after != 1.0:
            job.shard.div_(self.scaling.after)
        self.optimizer.accumulate_grad(job.flat, job.shard, job.final, job.presence)
