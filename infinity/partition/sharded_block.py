"""ShardedBlock: unshard (gather) and reshard of one block's flat parameters, as explicit states.

    SHARDED --start_unshard--> FETCHING --issue_gathers--> GATHERING --wait_unshard--> UNSHARDED --reshard--> SHARDED
    RESIDENT: every flat is resident (its full buffer is permanent); nothing to gather or free.

FETCHING: this rank's shards are on their way to where gathers read them (a disk read, a copy);
GATHERING: the all-gathers are issued. Shards come from a `ShardSource` (the shard store), so this
module moves no bytes between tiers itself; it runs the collectives and manages the gathered memory.
"""

from __future__ import annotations

import enum
import time
from typing import Protocol

import torch
from torch import nn

from infinity.partition.flat_param import FlatParam


class ShardFetch(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> torch.Tensor: ...


class ShardSource(Protocol):
    def fetch_param(self, flat: FlatParam) -> ShardFetch:
        """Start bringing this rank's compute-dtype shard of `flat` where gathers read it."""

    def release_param(self, flat: FlatParam, keep: bool = False) -> None:
        """The fetched shard has been gathered (the collective that read it is complete); `keep`: a copy
        may stay cached (a backward gather, whose shard the optimizer reads soon)."""

    def read_ahead(self, flats: list[FlatParam]) -> None:
        """Start reading these shards from slower tiers into host memory, in order, as far as it fits."""

    def owes(self, flat: FlatParam) -> bool:
        """An update of `flat` is still to be applied (a deferred step; replicated weights arriving)."""

    def settle(self, flat: FlatParam) -> None:
        """Apply the update owed to `flat`, waiting for it if need be (no-op if none is owed)."""


class BlockState(enum.Enum):
    SHARDED = "sharded"
    FETCHING = "fetching"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"
    RESIDENT = "resident"


class ShardedBlock:
    """One block: its module, its flat parameters, and the state of their gather."""

    def __init__(self, index: int, name: str, module: nn.Module | None, flats: list[FlatParam]) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.flats = flats
        self.numel = sum(f.padded_numel for f in flats)
        self.trainable = [p for f in flats if f.requires_grad for p in f.params]
        self.gathered_bytes = sum(f.padded_numel * f.full.element_size() for f in flats)
        self.grads_ready = 0
        self.issued_ns = 0  # when the current gather started (its fetches)
        self._fetches: list[tuple[FlatParam, ShardFetch]] = []
        self._works: list[tuple[FlatParam, object]] = []
        self._keep = False  # whether the gathered shards' copies may stay cached (see issue_gathers)
        self.state = BlockState.UNSHARDED  # the engine shards the flats after building the block
        self.sync_state()

    def sync_state(self) -> None:
        """Take the state from the flats (after the engine sharded or made them resident)."""
        if self.flats and all(f.resident for f in self.flats):
            self.state = BlockState.RESIDENT
        elif all(f.unsharded for f in self.flats):
            self.state = BlockState.UNSHARDED
        else:
            self.state = BlockState.SHARDED

    @property
    def unsharded(self) -> bool:
        """The full weights are in place (a gather finished, or resident)."""
        return self.state in (BlockState.UNSHARDED, BlockState.RESIDENT)

    @property
    def resident(self) -> bool:
        return self.state is BlockState.RESIDENT

    @property
    def in_flight(self) -> bool:
        return self.state in (BlockState.FETCHING, BlockState.GATHERING)

    @property
    def holds_memory(self) -> bool:
        """Gathered or being gathered, in memory that resharding frees (not resident)."""
        return self.state in (BlockState.FETCHING, BlockState.GATHERING, BlockState.UNSHARDED)

    def _expect(self, *states: BlockState) -> None:
        if self.state not in states:
            raise RuntimeError(f"block {self.name} is {self.state.value}, expected {[s.value for s in states]}")

    def start_unshard(self, source: ShardSource) -> None:
        """SHARDED -> FETCHING: start fetching this rank's shards, without waiting."""
        self._expect(BlockState.SHARDED)
        self.issued_ns = time.perf_counter_ns()
        self._fetches = [(flat, source.fetch_param(flat)) for flat in self.flats if not flat.unsharded]
        self.state = BlockState.FETCHING

    def fetched(self) -> bool:
        return all(handle.done() for _, handle in self._fetches)

    def issue_gathers(self, source: ShardSource, keep: bool = False) -> None:
        """FETCHING -> GATHERING: wait for the fetched shards and issue the all-gathers (a copy at one rank).

        Callers issue blocks in the same order on every rank (collectives must match across ranks); `keep`
        is passed to `release_param`."""
        self._expect(BlockState.FETCHING)
        fetches, self._fetches = self._fetches, []
        works = []
        while fetches:
            flat, handle = fetches[0]
            try:
                work = flat.unshard(handle.wait(), async_op=True)
            except BaseException:
                for other, _ in fetches:  # a failed fetch holds no reference; releasing it is a no-op
                    source.release_param(other)
                raise
            fetches.pop(0)
            if work is None:  # done already (one rank): the shard is no longer read
                source.release_param(flat, keep)
            else:
                works.append((flat, work))
        self._keep = keep
        self._works = works
        self.state = BlockState.GATHERING

    def ready(self) -> bool:
        """The weights are in place, or everything they wait for has completed (a prefetch hit)."""
        if self.state is BlockState.FETCHING:
            return self.fetched()
        if self.state is BlockState.GATHERING:
            return all(work.is_completed() for _, work in self._works)
        return self.unsharded

    def wait_unshard(self, source: ShardSource, keep: bool = False) -> None:
        """Block until the full weights are in place, starting and issuing what was not yet (`keep`: see
        `issue_gathers`)."""
        if self.state is BlockState.SHARDED:
            self.start_unshard(source)
        if self.state is BlockState.FETCHING:
            self.issue_gathers(source, keep)
        if self.state is BlockState.GATHERING:
            works, self._works = self._works, []
            for flat, work in works:
                try:
                    work.wait()
                finally:
                    source.release_param(flat, self._keep)
            self.state = BlockState.UNSHARDED

    def reshard(self) -> None:
        """UNSHARDED -> SHARDED: free the gathered memory (a resident or sharded block stays as it is)."""
        if self.state is BlockState.UNSHARDED:
            for flat in self.flats:
                flat.reshard()
            self.state = BlockState.SHARDED
        elif self.in_flight:
            raise RuntimeError(f"block {self.name} is {self.state.value}: wait for its gather before resharding")
