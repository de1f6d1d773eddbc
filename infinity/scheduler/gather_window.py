"""GatherWindow: which blocks are gathered, in what order on every rank, and how far ahead.

Gathers are issued in one order on every rank (collectives must match): blocks enter a queue when
their shards start to be fetched, and a block's all-gathers are issued only after those of every
block queued before it, as soon as its own shards have arrived. Before any other collective (a
gradient reduction) the queue is flushed, so that point of the program orders them on every rank.

Ahead of the block computing, the next blocks of the recorded order are gathered up to
`prefetch_bucket_elems`, never past `max_live_elems` gathered; those beyond are read ahead into host
memory. `BlockScheduler` (the hooks) builds on it.
"""

from __future__ import annotations

import enum
import time
from collections import deque

from infinity.partition.sharded_block import BlockState, ShardedBlock, ShardSource
from infinity.profiler.null_writer import NullTraceWriter


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    REPLAY = "replay"  # a block's gradient recomputed for a deferred step (`BlockInputs.recompute`): no hooks act


class GatherWindow:
    """The gather queue, the prefetch window and their counters (stalls, prefetch hits, high water)."""

    def __init__(
        self,
        blocks: list[ShardedBlock],
        source: ShardSource,
        prefetch_bucket_elems: int,
        max_live_elems: int,
        gather_waits_on: str,
        collectives: bool,
        prof=None,
    ) -> None:
        self.blocks = blocks
        self.source = source
        self.prefetch_bucket_elems = prefetch_bucket_elems
        self.max_live_elems = max_live_elems
        self.gather_waits_on = gather_waits_on
        self.collectives = collectives
        self.prof = prof if prof is not None else NullTraceWriter()
        self.phase = Phase.IDLE
        self.stall_s = 0.0
        self.prefetches_issued = 0
        self.uses = 0  # times compute reached a block
        self.prefetch_hits = 0  # ... and found its weights already there
        self._gather_queue: deque[ShardedBlock] = deque()  # FETCHING blocks, in the order they started
        self.gathered_high_water_bytes = 0  # the most gathered (or being gathered) weights held at once

    @staticmethod
    def prefetched_bytes_bound(full_block_elems: int, prefetch_bucket_elems: int, itemsize: int) -> int:
        """Weights gathered ahead at most: the prefetch bucket, at least the next block (a non-zero bucket always
        takes it)."""
        return (max(full_block_elems, prefetch_bucket_elems) if prefetch_bucket_elems else 0) * itemsize

    @staticmethod
    def gathered_bytes_bound(full_block_elems: int, prefetch_bucket_elems: int, itemsize: int) -> int:
        """Gathered weights held at most: the block computing, one being reduced, and those gathered ahead."""
        ahead = GatherWindow.prefetched_bytes_bound(full_block_elems, prefetch_bucket_elems, itemsize)
        return 2 * full_block_elems * itemsize + ahead

    @staticmethod
    def working_set_bytes(
        full_block_elems: int, prefetch_bucket_elems: int, itemsize: int, optimizer_window: int
    ) -> int:
        """Memory the compute holds at most: gathered weights (`gathered_bytes_bound`) and fp32 gradients
        (autograd's, the flat copy, and those waiting for the optimizer: half its window)."""
        grads = (2 + optimizer_window // 2) * full_block_elems * 4
        return GatherWindow.gathered_bytes_bound(full_block_elems, prefetch_bucket_elems, itemsize) + grads

    def _live_elems(self) -> int:
        return sum(b.numel for b in self.blocks if b.holds_memory)

    def _start(self, block: ShardedBlock) -> None:
        block.start_unshard(self.source)
        self._gather_queue.append(block)
        self._note_gathered()

    def _note_gathered(self) -> None:
        held = sum(b.gathered_bytes for b in self.blocks if b.holds_memory)
        self.gathered_high_water_bytes = max(self.gathered_high_water_bytes, held)

    def _keep(self) -> bool:
        """A backward gather's shard copies may stay cached: the optimizer reads those shards next."""
        return self.phase is Phase.BACKWARD

    def _issue_arrived(self) -> None:
        """Issue the gathers of queued blocks whose shards have arrived, in queue order."""
        queue = self._gather_queue
        while queue and (queue[0].state is not BlockState.FETCHING or queue[0].fetched()):
            head = queue.popleft()
            if head.state is BlockState.FETCHING:
                head.issue_gathers(self.source, self._keep())

    def _issue_all(self) -> None:
        """Issue every queued gather (waiting for their shards). Called before any other collective: each
        rank issues a gather when its own shard arrives, so only a flush at the same point of the program
        on every rank keeps all collectives in one order (a reduce-scatter overtaking an all-gather on
        one rank but not another would deadlock them)."""
        while self._gather_queue:
            head = self._gather_queue.popleft()
            if head.state is BlockState.FETCHING:
                head.issue_gathers(self.source, self._keep())

    def _issue_through(self, block: ShardedBlock) -> None:
        """Issue the gathers queued before `block` (waiting for their shards), so `block`'s come next."""
        queue = self._gather_queue
        while queue:
            head = queue.popleft()
            if head.state is BlockState.FETCHING:
                head.issue_gathers(self.source, self._keep())
            if head is block:
                return

    def _ensure_gathered(self, block: ShardedBlock) -> None:
        prof = self.prof
        if block.index >= 0:
            ready = block.ready()
            self.uses += 1
            self.prefetch_hits += ready
            prof.use(block.name, bool(ready))
        if block.resident:
            self._settle_resident(block)
            return
        if block.unsharded:
            return
        in_flight = block.in_flight
        # what the wait is for: the collective once issued (several ranks), else the shard's fetch
        waited_on = "all-gather" if block.state is BlockState.GATHERING and self.collectives else self.gather_waits_on
        if block.state is BlockState.SHARDED:
            # Starting the fetch first applies an optimizer step deferred to this use, outside the gather's
            # stall: the step records its own waits ("optimizer step") and compute, which a gather's stall
            # would have swallowed and labelled as the parameters' read. The gathers queued before go first,
            # in the same order as ever, to run behind that step.
            self._issue_all()
            self._start(block)
        start = time.perf_counter_ns()
        issued = block.issued_ns if in_flight else start
        prof.open_span("stall")  # a wait inside this one (for pool memory) is part of it
        try:
            self._issue_through(block)
            block.wait_unshard(self.source, self._keep())
        finally:
            prof.close_span("stall")
        self._note_gathered()
        end = time.perf_counter_ns()
        self.stall_s += (end - start) / 1e9
        prof.stall(block.name, start, end, waited_on)
        if self.collectives:
            prof.collective("all-gather", block.name, block.gathered_bytes, issued, end)

    def _settle_resident(self, block: ShardedBlock, stall: bool = True) -> None:
        """Resident weights may still be arriving (stages 1-2 share the updated partitions behind the
        forward; one rank steps them just before they are used): wait for the block's, as a stall on the
        all-gather when compute waits for them. At one rank what is owed is the optimizer step, which
        records its own waits and compute."""
        owed = [f for f in block.flats if self.source.owes(f)]
        if not owed:
            return
        stall = stall and self.collectives
        start = time.perf_counter_ns()
        if stall:
            self.prof.open_span("stall")
        try:
            for flat in owed:
                self.source.settle(flat)
        finally:
            if stall:
                self.prof.close_span("stall")
        if stall:
            end = time.perf_counter_ns()
            self.stall_s += (end - start) / 1e9
            self.prof.stall(block.name, start, end, "all-gather")

    def _prefetch(self, upcoming: list[int], current: int) -> None:
        """Gather the next blocks within the bucket; read the blocks beyond it ahead into host memory.

        The bucket bounds what is gathered (or on its way) ahead of the block computing, `current`: blocks
        an earlier prefetch left in flight count against it. Which blocks are gathered depends only on the
        trace and the limits, never on timing (such as whether a read has finished), so every rank queues
        its gathers in the same order.
        """
        budget = self.prefetch_bucket_elems
        live = self._live_elems()
        beyond: list[int] = []
        counted = {current}
        for position, index in enumerate(upcoming):
            block = self.blocks[index]
            if block.state is not BlockState.SHARDED:
                if block.holds_memory and index not in counted:
                    counted.add(index)
                    budget = max(0, budget - block.numel)
                continue
            # as in DeepSpeed, a non-zero bucket always takes the next block, even one larger than the bucket
            first = 0 < budget == self.prefetch_bucket_elems
            if (block.numel > budget and not first) or live + block.numel > self.max_live_elems:
                beyond = upcoming[position:]
                break
            self._start(block)
            counted.add(index)
            self.prefetches_issued += 1
            self.prof.prefetch(block.name)
            budget = max(0, budget - block.numel)
            live += block.numel
        self._issue_arrived()
        ahead = dict.fromkeys(i for i in beyond if self.blocks[i].state is BlockState.SHARDED)
        if ahead:
            self.source.read_ahead([f for i in ahead for f in self.blocks[i].flats])
