"""Stages 1-2 with several ranks: each rank stepped its own range of every replicated flat; after the step
the ranges are all-gathered back into every rank's parameters, behind the next forward.

All the all-gathers are issued when the step ends, in the order the next forward reads the flats, in
buckets of at most `allgather_bucket_size` elements that never span blocks. Each flat is owed its
bucket's arrival (`ShardStore.owe`): the first reader of its weights (the block's forward, a read by
attribute, `state_dict()`, any store verb, `engine.close()`) waits for exactly that bucket while the
rest arrives behind the compute. Waiting never issues a collective, so ranks may settle in different
orders (one rank reading weights between steps) without their collectives diverging.
"""

from __future__ import annotations

import time

import torch

from infinity.partition import FlatParam
from infinity.shards import ShardKind, ShardStore


class _Bucket:
    """One all-gather in flight for the updated ranges of `flats` (of one block)."""

    def __init__(self, shards: ShardStore, flats: list[FlatParam], prof) -> None:
        self.flats = flats
        self.prof = prof
        comm = shards.comm
        ranges = [shards.shard_view(f, ShardKind.PARAM) for f in flats]
        if len(flats) == 1:  # straight into the flat's own buffer; the input must not alias it
            self._input, self._output = ranges[0].clone(), flats[0].full
        else:
            self._input = torch.cat(ranges)
            self._output = torch.empty(self._input.numel() * comm.world_size, dtype=self._input.dtype,
                                       device=self._input.device)  # fmt: skip
        self.world_size = comm.world_size
        self.start_ns = time.perf_counter_ns()
        what = f"updated weights of {flats[0].name}" + (f" and {len(flats) - 1} more flats" if len(flats) > 1 else "")
        self._work = comm.all_gather(self._output, self._input, what, async_op=True)
        self._arrived = False
        for flat in flats:
            shards.owe(flat, self.arrive)
        self._shards = shards

    def arrive(self, _flat: FlatParam | None = None) -> None:
        """Wait for the collective and put every flat's new weights in place (once)."""
        if self._arrived:
            return
        self._arrived = True
        for flat in self.flats:
            self._shards.discharge(flat)
        self._work.wait()
        if len(self.flats) > 1:  # output: every rank's ranges of all flats; each flat.full: every rank's range
            per_rank = self._output.view(self.world_size, self._input.numel())
            offset = 0
            for flat in self.flats:
                flat.full.view(self.world_size, flat.shard_numel).copy_(per_rank[:, offset : offset + flat.shard_numel])
                offset += flat.shard_numel
        self._input = self._output = None
        nbytes = sum(f.full.numel() * f.full.element_size() for f in self.flats)
        self.prof.collective("all-gather", self.flats[0].name, nbytes, self.start_ns, time.perf_counter_ns())


class PartitionSharing:
    """Shares the updated partitions of replicated parameters after each step (see the module docstring);
    does nothing where parameters are not replicated (stage 3) or there is one rank."""

    def __init__(self, shards: ShardStore, bucket_elems: int, prof) -> None:
        self.shards = shards
        self.bucket_elems = bucket_elems
        self.prof = prof
        self.active = shards.placement.params_resident and shards.comm.world_size > 1
        self._in_flight: list[_Bucket] = []

    @torch.no_grad()
    def share(self, blocks_in_order: list[list[FlatParam]]) -> None:
        """Issue the all-gathers of the updated ranges, block by block in the order the next forward runs."""
        if not self.active:
            return
        self.wait_all()  # a previous step's (nothing read those weights since): before the new values
        placed = {f for flats in blocks_in_order for f in flats}
        rest = [[f] for f in self.shards.flats if f not in placed]  # in no block the forward reads
        for flats in [*blocks_in_order, *rest]:
            bucket: list[FlatParam] = []
            for flat in (f for f in flats if f.requires_grad):
                if bucket and sum(f.padded_numel for f in bucket) + flat.padded_numel > self.bucket_elems:
                    self._in_flight.append(_Bucket(self.shards, bucket, self.prof))
                    bucket = []
                bucket.append(flat)
            if bucket:
                self._in_flight.append(_Bucket(self.shards, bucket, self.prof))

    def wait_all(self) -> None:
        """Every rank's parameters hold the updated weights when this returns."""
        in_flight, self._in_flight = self._in_flight, []
        for bucket in in_flight:
            bucket.arrive()
