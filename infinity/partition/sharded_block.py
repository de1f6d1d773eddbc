"""ShardedBlock: unshard (gather) and reshard (release) of one block's flat parameters.

Shards come from a `ShardSource` (the engine's placement of shards on tiers), so this module moves
no bytes between tiers itself; it only runs the collectives and manages the gathered memory.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
from torch import nn

from infinity.partition.flat_param import FlatParam


class ShardFetch(Protocol):
    def done(self) -> bool: ...

    def wait(self) -> torch.Tensor: ...


class ShardSource(Protocol):
    def fetch(self, flat: FlatParam) -> ShardFetch:
        """Start bringing this rank's compute-dtype shard of `flat` where the compute can read it."""

    def acquire(self, flat: FlatParam) -> torch.Tensor:
        """This rank's compute-dtype shard of `flat`, where the compute can read it (`fetch(flat).wait()`)."""

    def release(self, flat: FlatParam) -> None:
        """The shard returned by `acquire` is no longer needed on the device."""

    def prefetch_to_host(self, flats: list[FlatParam]) -> None:
        """Start reading these shards from slower tiers into host memory, in order, as far as it fits."""


class ShardedBlock:
    """One block: its module, its flat parameters, and whether they are gathered or being gathered."""

    def __init__(self, index: int, name: str, module: nn.Module | None, flats: list[FlatParam]) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.flats = flats
        self.numel = sum(f.padded_numel for f in flats)
        self.trainable = [p for f in flats if f.requires_grad for p in f.params]
        self._pending: list | None = None  # async all-gather work handles
        self.issued_ns = 0  # when the pending all-gathers were issued
        self.gathered_bytes = sum(f.padded_numel * f.full.element_size() for f in flats)
        self.grads_ready = 0

    @property
    def gathered(self) -> bool:
        return all(f.gathered for f in self.flats) and self._pending is None

    @property
    def resident(self) -> bool:
        """Every flat is resident (world size 1): always gathered, at no cost."""
        return all(f.resident for f in self.flats)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def ready(self) -> bool:
        """Gathered, or every all-gather (one rank: every shard fetch) of a prefetch has completed."""
        if self._pending is None:
            return self.gathered
        return all(work is None or _done(work) for _, work in self._pending)

    def start_gather(self, source: ShardSource) -> None:
        """Issue the all-gathers without waiting (a prefetch).

        With several ranks the shard must be in place before its all-gather is issued, and all-gathers
        are issued here, in the same order on every rank. One rank has no collective: its shards are
        fetched without waiting, and the "gather" (a copy into the full buffer) happens in `wait_gather`.
        """
        if self._pending is not None or all(f.gathered for f in self.flats):
            return
        self.issued_ns = time.perf_counter_ns()
        works = []
        for flat in self.flats:
            if flat.gathered:
                continue
            if flat.comm.distributed:
                works.append((flat, flat.gather_from(source.acquire(flat), async_op=True)))
            else:
                works.append((flat, source.fetch(flat)))
        self._pending = works

    def wait_gather(self, source: ShardSource) -> None:
        """Block until the full weights are in place (gathering now if no prefetch was issued)."""
        if self._pending is None:
            self.start_gather(source)
        for flat, work in self._pending or ():
            if flat.comm.distributed:
                if work is not None:
                    work.wait()
            else:
                flat.gather_from(work.wait())
            source.release(flat)
        self._pending = None

    def release(self) -> None:
        for flat in self.flats:
            flat.release()


def _done(work) -> bool:
    """A collective's work handle or a shard fetch: has it completed?"""
    return work.is_completed() if hasattr(work, "is_completed") else work.done()
