"""The optimizer's path through the shard store: lend a shard's buffers, step in place, give them back.

A mixin of `ShardStore`. `lend` hands over the master, the packed moments (and the gradient sum) in host
or device memory, read from NVMe where that is their home; `give_back` routes the new weights to the
parameter shard, writes NVMe state home and lets go of the copies it read (each freed once its write is
done); `Returned.finish` waits for those writes.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from infinity.partition.flat_param import FlatParam
from infinity.shards.crossing import StagedCopy
from infinity.shards.kinds import OPTIM_KINDS, ShardKind
from infinity.shards.moments import packed_views
from infinity.storage import MoveHandle, Tier, aligned_empty

if TYPE_CHECKING:
    from infinity.shards.store import ShardStore


@dataclass
class LentShard:
    """One shard's optimizer buffers, lent for one in-place step (`ShardStore.lend`).

    `param_out` is where a step writes the new compute-dtype weights (the fused copy-out), or None when
    the master is the parameter shard itself."""

    flat: FlatParam
    master: torch.Tensor
    moments_buffer: torch.Tensor  # uint8: both moments packed in the placement's format
    moments: dict[str, torch.Tensor]  # views into it: exp_avg, exp_avg_sq (and their scales)
    grad: torch.Tensor | None
    param_out: torch.Tensor | None
    fetched: list[Hashable] = field(default_factory=list)  # keys whose host copies are held
    staged_out: StagedCopy | None = None  # `param_out`'s pinned buffer, when the new weights cross to the device

    @property
    def exp_avg(self) -> torch.Tensor:
        return self.moments["exp_avg"]

    @property
    def exp_avg_sq(self) -> torch.Tensor:
        return self.moments["exp_avg_sq"]


class Returned:
    """A lent shard given back: its writes in flight; `finish()` waits for them (the copies they read are
    released already: `release_copies`)."""

    def __init__(
        self, store: ShardStore, lent: LentShard, writes: list[MoveHandle], cached: frozenset[Hashable] = frozenset()
    ) -> None:
        self._store = store
        self._lent = lent
        self.writes = writes
        self._cached = cached  # fetched keys whose host copies stay cached after the writes
        self.flat = lent.flat

    def release_copies(self) -> None:
        """Let go of the host copies `lend` fetched: a write that reads one holds it until the write is done,
        and an evicted copy is freed then (`TierStore.evict`)."""
        for key in self._lent.fetched:
            # a copy the gather reads next is kept from the read-ahead's eviction, as a prefetch is
            self._store.tiers.release(key, Tier.HOST, keep=key in self._cached)
            if key not in self._cached:
                self._store.tiers.evict(key)
        self._lent.fetched = []

    def finish(self) -> None:
        try:
            for handle in self.writes:
                handle.wait()
        finally:
            self.release_copies()
            if self._lent.staged_out is not None:  # after the copy to the device read it
                self._store.crossing.release(self._lent.staged_out)
                self._lent.staged_out = None


class OptimizerLending:
    """`ShardStore`'s lend/give-back verbs; see the module docstring."""

    def prefetch_state(self, flats: Iterable[FlatParam], with_grad: bool, master: bool = True) -> None:
        """Start reading the optimizer state `lend` will need into host memory (NVMe homes), in order;
        without `master`, the moments (and gradient) only."""
        if self.placement.optim_home is Tier.NVME:
            keys = []
            for flat in flats:
                keys += [self.key(flat, kind) for kind in OPTIM_KINDS if master or kind is not ShardKind.MASTER]
                # a held gradient is in memory already, a recomputed one is made in memory
                if with_grad and flat not in self._held_grads and flat not in self._replay_owed:
                    keys.append(self.key(flat, ShardKind.GRAD))
            self.tiers.prefetch(keys, Tier.HOST)

    def lend(self, flat: FlatParam, with_grad: bool, gather_next: bool = False) -> LentShard:
        """`flat`'s master, moments (and gradient sum) for one in-place step: the home buffers in memory, or
        host copies read from NVMe (waiting for them); give them back with `give_back`. `gather_next`: as
        `give_back`'s; the new 16-bit weights of an NVMe parameter shard then go into its host copy."""
        self.settle(flat)
        if with_grad:
            self._land_grads()
        fetched: list[Hashable] = []

        def buffer(kind: ShardKind) -> torch.Tensor:
            view = self.shard_view(flat, kind) if kind is not ShardKind.GRAD else self._take_held_grad(flat)
            if view is not None:
                return view
            key = self.key(flat, kind)
            fetched.append(key)
            return self.tiers.fetch(key, Tier.HOST).wait()

        try:
            master, packed = (buffer(k) for k in OPTIM_KINDS)
            grad = buffer(ShardKind.GRAD) if with_grad else None
        except BaseException:
            for key in fetched:
                self.tiers.release(key, Tier.HOST)
            raise
        packed = packed.view(torch.uint8)
        moments = packed_views(packed, self.placement.moments, flat.shard_numel)
        lent = LentShard(flat, master, packed, moments, grad, None, fetched)
        if self.placement.weights_cross_to_device and not self.placement.master_is_param:
            # stepped on the host into a pinned buffer, then copied up to the parameter shard (`give_back`)
            lent.staged_out = self.crossing.buffer(flat.shard_numel, self.placement.compute_dtype)
            lent.param_out = lent.staged_out.host
        elif gather_next and self._param_copy_kept(master):
            # the gather reads the new weights from this copy, not back from NVMe; the step overwrites it whole
            key = self.key(flat, ShardKind.PARAM)
            try:
                lent.param_out = self.tiers.fetch_to_overwrite(key, Tier.HOST)
            except BaseException:
                for held in fetched:
                    self.tiers.release(held, Tier.HOST)
                raise
            fetched.append(key)
        else:
            lent.param_out = self._param_out(flat, master)
        return lent

    def _param_copy_kept(self, master: torch.Tensor) -> bool:
        """A separate parameter shard on NVMe, stepped in host memory: its host copy can stay cached."""
        p = self.placement
        return p.param_home is Tier.NVME and not p.master_is_param and master.device.type == "cpu"

    def _param_out(self, flat: FlatParam, master: torch.Tensor) -> torch.Tensor | None:
        p = self.placement
        if p.master_is_param:
            return None
        view = self.shard_view(flat, ShardKind.PARAM)
        if view is not None and view.device == master.device:
            return view  # the step writes the new weights straight into the parameter shard
        out = aligned_empty(flat.shard_numel * p.compute_dtype.itemsize).view(p.compute_dtype)
        return out if master.device.type == "cpu" else out.to(master.device)

    def give_back(self, lent: LentShard, param_written: bool, gather_next: bool = False) -> Returned:
        """The step on `lent` is done (`param_written`: it also wrote `param_out`): the new weights go to the
        parameter shard, NVMe state is written home; `finish()` the result before reusing the memory.

        `gather_next`: the next forward's gather reads this shard next (a step deferred until then). The
        parameter shard's host copy (the master itself in fp32; the copy `lend` gave as `param_out` with
        16-bit compute) then stays cached once written, so that the gather reads the new weights from
        memory, not back from NVMe."""
        flat, p = lent.flat, self.placement
        writes: list[MoveHandle] = []
        if p.optim_home is Tier.NVME:
            writes.append(self.tiers.write(self.key(flat, ShardKind.MASTER), lent.master))
            writes.append(self.tiers.write(self.key(flat, ShardKind.MOMENTS), lent.moments_buffer))
        param_key = self.key(flat, ShardKind.PARAM)
        out = lent.param_out
        view = self.shard_view(flat, ShardKind.PARAM)
        if out is not None:
            if not param_written:
                out.copy_(lent.master)
            if lent.staged_out is not None:  # the compute stream waits for it; `finish` frees the buffer after it
                self.crossing.to_device(view, lent.staged_out)
            elif view is not None and out.data_ptr() != view.data_ptr():
                view.copy_(out)  # a host-stepped shard whose parameters live in device memory
            elif view is None:
                writes.append(self.tiers.write(param_key, out))
        if p.param_home is not Tier.NVME:
            self.tiers.evict(param_key)  # copies above the home are stale
        keep_for_gather = gather_next and param_key in lent.fetched
        returned = Returned(self, lent, writes, frozenset((param_key,)) if keep_for_gather else frozenset())
        returned.release_copies()
        return returned
