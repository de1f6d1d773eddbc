"""ShardStore: the one owner of every byte of each flat parameter on this rank.

Per trainable flat: the compute-dtype parameter shard, the fp32 master, the Adam moments (both in one
packed buffer, in the placement's moment format: fp32, bf16 or 8-bit) and the gradient accumulator,
each a key `(flat name, kind)` in the `TierStore` on the tier the `Placement` says (when the master is
the parameter shard, both kinds name one key). Frozen flats have only their
parameter shard. With resident parameters the parameter key holds the whole flat and the parameters
are views of it; this rank's shard is its range of that.

Everyone else reaches those bytes through a few verbs: `read` a shard (host copy), `assign` new
weights (and optionally moments), `gather_full` a flat, `fetch_param` for a gather, `lend` the
buffers for one in-place optimizer step and `give_back` them. Gradients enter through
`accumulate_grad` (or `final_grad` when the step runs as they arrive).

An update may be owed to a shard (`owe`: its step was deferred until the shard is next needed); every
verb that reads or replaces a shard's bytes settles what is owed to it first, so nobody ever sees the
bytes before the step they are waiting for.

Where the device is apart from the host (`Placement.device_apart`), gradients cross to the host in the
compute dtype and new weights cross back through `crossing.DeviceHostCopies`: a gradient is summed into
its host accumulator (promoted to fp32 there) when the next one has started its copy, or before anyone
reads the accumulators (`finish_grad_writes`, `read`, `lend`, `final_grad`, `zero_grad`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable

import torch

from infinity.comm import CommGroup
from infinity.partition.flat_param import FlatParam
from infinity.profiler.null_writer import NullTraceWriter
from infinity.shards import registry
from infinity.shards.crossing import DeviceHostCopies, StagedCopy
from infinity.shards.grad_presence import GradPresence
from infinity.shards.gradients import GRADS_IN_FLIGHT, GradientAccumulators, GradReplay
from infinity.shards.kinds import ShardKind, ShardRecord
from infinity.shards.lending import OptimizerLending
from infinity.shards.moments import MOMENT_NAMES, decode, encode, moment_format, packed_views
from infinity.shards.policy import Placement, StepTiming
from infinity.storage import FetchHandle, MoveHandle, Tier, TierStore


class ShardStore(GradientAccumulators, GradPresence, OptimizerLending):
    """This rank's shards of every flat, on the tiers `placement` names; see the module docstring."""

    def __init__(
        self,
        tiers: TierStore,
        placement: Placement,
        comm: CommGroup,
        read_ahead_bytes: int | None = None,
        grad_writes_in_flight: int = 2,
        grad_hold_bytes: int = 0,
        prof=None,
    ) -> None:
        """`grad_hold_bytes`: gradients that wait for their step with an NVMe home stay in host memory instead,
        up to this many bytes (`GradientAccumulators`); `prof`: the trace writer the training thread's waits
        for gradient writes are recorded in."""
        self.tiers = tiers
        self.placement = placement
        self.comm = comm
        self.read_ahead_bytes = read_ahead_bytes  # NVMe parameter shards read ahead into host memory; None: no cap
        self.grad_writes_in_flight = max(1, grad_writes_in_flight)
        self.flats: list[FlatParam] = []  # every flat, in the order added
        self.records: dict[FlatParam, ShardRecord] = {}  # the trainable ones
        self._views: dict[Hashable, torch.Tensor] = {}  # home copies in memory, by key
        self._grad_writes: deque[tuple[MoveHandle, torch.Tensor, str]] = deque()  # (write, its source, flat name)
        self.prof = prof if prof is not None else NullTraceWriter()
        self.grad_hold_bytes = grad_hold_bytes
        self._held_grads: dict[FlatParam, torch.Tensor] = {}  # gradient sums kept in host memory, not on NVMe
        self.grad_replay: GradReplay | None = None  # recomputes gradients for deferred steps (the engine sets it)
        self._replay_owed: dict[FlatParam, float] = {}  # flats whose gradient is to be recomputed: its norm^2
        self._replay_trials: dict[FlatParam, float | None] = {}  # recomputed to compare: relative error once known
        self._replay_trusted: set[FlatParam] = set()  # their trial matched: recomputed alone from then on
        self._owed: dict[FlatParam, Callable[[FlatParam], None]] = {}  # updates not yet applied
        self.crossing = DeviceHostCopies(tiers.copies, placement.compute_dtype)
        self._grads_crossing: deque[tuple[FlatParam, bool, StagedCopy]] = deque()  # copies to the host in flight
        self.param_bytes_fetched = 0  # parameter shard bytes gathers asked to move from their home tier

    # -- declared memory bounds (the memory plan sums them) ----------------------------------------

    @staticmethod
    def gather_host_bytes(shard_elems: int, held_elems: int, itemsize: int) -> int:
        """Host memory for NVMe parameter shards in flight: one being gathered, one being written, and the
        `held_elems` fetched ahead and held until their gather (where gathers read host copies)."""
        return (held_elems + 2 * shard_elems) * itemsize

    @staticmethod
    def kept_param_bytes(block_shard_elems: int, flat_shard_elems: int, arrivals: int) -> int:
        """Host memory for backward gathers' copies kept for a step during backward (`release_param`): the
        block in backward, and the `arrivals` flats the optimizer has not stepped yet (fp32: one slot)."""
        return (block_shard_elems + max(1, arrivals) * flat_shard_elems) * 4

    @staticmethod
    def grad_staging_bytes(shard_elems: int, itemsize: int) -> int:
        """Pinned host memory for gradients crossing from the device: one in flight, one being summed."""
        return (GRADS_IN_FLIGHT + 1) * shard_elems * itemsize

    @property
    def grad_bytes_to_host(self) -> int:
        """Gradient bytes copied from device memory to the host (in the compute dtype)."""
        return self.crossing.grad_bytes_to_host

    @staticmethod
    def grad_accumulation_bytes(shard_elems: int) -> int:
        """Host memory for adding a micro-batch's gradient into an accumulator on NVMe (one shard, fp32)."""
        return 4 * shard_elems

    # -- updates owed ------------------------------------------------------------------------------

    def owe(self, flat: FlatParam, settle: Callable[[FlatParam], None]) -> None:
        """An update of `flat`'s shard is deferred: `settle(flat)` applies it, before anyone uses the bytes."""
        self._owed[flat] = settle

    def owes(self, flat: FlatParam) -> bool:
        return flat in self._owed

    def discharge(self, flat: FlatParam) -> None:
        """The update owed to `flat` is being applied by its owner (who must not be called back for it)."""
        self._owed.pop(flat, None)

    def settle(self, flat: FlatParam) -> None:
        settle = self._owed.pop(flat, None)
        if settle is not None:
            settle(flat)

    def settle_all(self) -> None:
        while self._owed:
            self.settle(next(iter(self._owed)))

    # -- keys and views ---------------------------------------------------------------------------

    def key(self, flat: FlatParam, kind: ShardKind) -> tuple[str, str]:
        """The store key of `flat`'s `kind`; the flat's name comes first (the profiler names blocks by it)."""
        if kind is ShardKind.MASTER and self.placement.master_is_param:
            kind = ShardKind.PARAM
        return (flat.name, kind.value)

    def _home(self, kind: ShardKind) -> Tier:
        return self.placement.param_home if kind is ShardKind.PARAM else self.placement.optim_home

    def shard_view(self, flat: FlatParam, kind: ShardKind) -> torch.Tensor | None:
        """This rank's shard of `kind` where it lives, when that is memory (updated in place), else None."""
        key = self.key(flat, kind)
        view = self._views.get(key)
        if view is not None and key[1] == ShardKind.PARAM.value and self.placement.params_resident:
            start, end = flat.shard_range  # the key holds the whole flat: this rank's range of it
            view = view[start:end]
        return view

    def _put(self, flat: FlatParam, kind: ShardKind, value: torch.Tensor) -> None:
        key, home = self.key(flat, kind), self._home(kind)
        self.tiers.put(key, value.contiguous(), home).wait()
        if home is not Tier.NVME:  # home copies in memory are permanent: keep a view of them
            self._views[key] = self.tiers.fetch(key, home).wait()
            self.tiers.release(key, home)

    # -- ownership --------------------------------------------------------------------------------

    def add(self, flat: FlatParam, full32: torch.Tensor) -> None:
        """Take over `flat`'s bytes from its initial fp32 values (identical on every rank): the parameter
        shard (the whole flat when resident), and for a trainable flat its master and zero moments."""
        p = self.placement
        start, end = flat.shard_range
        param = full32 if p.params_resident else full32[start:end]
        self._put(flat, ShardKind.PARAM, param.to(p.compute_dtype))
        if flat.requires_grad:
            self.records[flat] = ShardRecord()
            if not p.master_is_param:
                self._put(flat, ShardKind.MASTER, full32[start:end])
            self._put(flat, ShardKind.MOMENTS, torch.zeros(self._moments_bytes(flat), dtype=torch.uint8))
            if p.optim_home is not Tier.NVME:  # on NVMe the slot is made by the first gradient written
                self._put(flat, ShardKind.GRAD, torch.zeros(flat.shard_numel, dtype=torch.float32))
        if p.params_resident:
            flat.make_resident(self._views[self.key(flat, ShardKind.PARAM)])
        self.flats.append(flat)
        registry.register(flat, self)

    def close(self) -> None:
        """Forget every flat and free the tiers (the NVMe swap file is removed)."""
        self.finish_grad_writes()
        registry.forget(self)
        self.tiers.close()
        self.crossing.close()

    # -- reading and assigning --------------------------------------------------------------------

    def _moments_bytes(self, flat: FlatParam) -> int:
        return moment_format(self.placement.moments).state_bytes(flat.shard_numel)

    def read(self, flat: FlatParam, kind: ShardKind) -> torch.Tensor:
        """A host copy of this rank's shard of `kind` (compute dtype for PARAM, fp32 for MASTER, fp32 or
        `placement.grad_dtype` for GRAD, the packed bytes for MOMENTS: see `read_moments`)."""
        self.settle(flat)
        self._land_grads()
        view = self.shard_view(flat, kind) if kind is not ShardKind.GRAD else self._grad_in_memory(flat)
        if view is not None:
            return view.detach().to("cpu", copy=True)
        key = self.key(flat, kind)
        try:
            return self.tiers.fetch(key, Tier.HOST).wait().clone()
        finally:
            self.tiers.release(key, Tier.HOST)

    def read_moments(self, flat: FlatParam) -> dict[str, torch.Tensor]:
        """Host copies of the shard's stored moments: exp_avg, exp_avg_sq (and their scales), in the
        placement's format (`placement.moments`)."""
        return packed_views(self.read(flat, ShardKind.MOMENTS), self.placement.moments, flat.shard_numel)

    def read_weights(self, flat: FlatParam) -> torch.Tensor:
        """This rank's shard of the weights in fp32: the master when trainable, else the parameter shard."""
        if flat.requires_grad:
            return self.read(flat, ShardKind.MASTER)
        return self.read(flat, ShardKind.PARAM).float()

    def gather_full(self, flat: FlatParam, fp32: bool = True) -> torch.Tensor:
        """The whole flat on the compute device, the same on every rank (a collective: every rank calls it):
        fp32 weights (masters where trainable), or with `fp32` False the compute-dtype parameters."""
        shard = self.read_weights(flat) if fp32 else self.read(flat, ShardKind.PARAM)
        shard = shard.to(self.placement.compute_device)
        full = torch.empty(flat.padded_numel, dtype=shard.dtype, device=shard.device)
        self.comm.all_gather(full, shard, f"full weights of {flat.name}")
        return full

    def assign(
        self,
        flat: FlatParam,
        master32: torch.Tensor,
        moments: tuple[str, dict[str, torch.Tensor]] | None = None,
        step: int | None = None,
        slot_steps: list[int] | None = None,
    ) -> None:
        """New fp32 weights for this rank's shard of `flat` (optionally its Adam moments, as (format name,
        tensors by name) in any format, and step count, with `slot_steps` its parameters' own where they differ):
        the master takes them, the parameter shard their compute-dtype cast. A resident flat's other ranks'
        ranges and a gathered copy are the caller's to refresh (`sync_resident`, `reshard`)."""
        self.settle(flat)  # a deferred step must not overwrite the new values later
        master32 = master32.detach().to("cpu", torch.float32).reshape(-1)
        if flat.requires_grad and not self.placement.master_is_param:
            self._write(flat, ShardKind.MASTER, master32)
        self._write(flat, ShardKind.PARAM, master32.to(self.placement.compute_dtype))
        if moments is not None:
            self._write(flat, ShardKind.MOMENTS, self._packed(flat, *moments))
        if step is not None:
            self.records[flat].step = step
            # per-parameter counts only where parameters step alone (fp32 moments: `optim.param_steps`)
            per_param = slot_steps is not None and self.placement.moments == "fp32"
            self.records[flat].slot_steps = [int(c) for c in slot_steps] if per_param else None

    def _packed(self, flat: FlatParam, fmt: str, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """`values` (moments stored in format `fmt`) packed in this placement's format, converted if need be."""
        mine = self.placement.moments
        buffer = torch.empty(self._moments_bytes(flat), dtype=torch.uint8)
        views = packed_views(buffer, mine, flat.shard_numel)
        for name in MOMENT_NAMES:
            scale_name = f"{name}_scale"
            if fmt == mine:
                codes, scale = values[name], values.get(scale_name)
            else:  # through fp32, rounded to nearest in the new format
                codes, scale = encode(decode(values[name], values.get(scale_name), fmt, name), mine, name)
            views[name].copy_(codes.reshape(-1))
            if scale is not None:
                views[scale_name].copy_(scale.reshape(-1))
        return buffer

    def assign_param(self, flat: FlatParam, shard: torch.Tensor) -> None:
        """New compute-dtype weights for a frozen flat's shard."""
        self.settle(flat)
        self._write(flat, ShardKind.PARAM, shard.detach().to("cpu", self.placement.compute_dtype).reshape(-1))

    def sync_resident(self, flat: FlatParam) -> None:
        """After `assign` on every rank: all-gather a resident flat's ranges so each rank holds all of them."""
        if flat.resident and self.comm.world_size > 1:
            view = self.shard_view(flat, ShardKind.PARAM)
            self.comm.all_gather(flat.full, view.clone(), f"assigned weights of {flat.name}")

    def _write(self, flat: FlatParam, kind: ShardKind, value: torch.Tensor) -> None:
        view = self.shard_view(flat, kind)
        if view is not None:
            with torch.no_grad():
                view.copy_(value)
            self.tiers.evict(self.key(flat, kind))  # cached copies above the home are stale now
        else:
            self.tiers.write(self.key(flat, kind), value.contiguous()).wait()

    # -- the compute's path: parameter shards for gathers -------------------------------------------

    def fetch_param(self, flat: FlatParam) -> FetchHandle:
        """Start bringing this rank's parameter shard where gathers read it; `release_param` when gathered."""
        self.settle(flat)
        if self.placement.param_home is not self.placement.gather_from:
            self.param_bytes_fetched += flat.shard_numel * self.placement.compute_dtype.itemsize
        return self.tiers.fetch(self.key(flat, ShardKind.PARAM), self.placement.gather_from)

    def release_param(self, flat: FlatParam, keep: bool = False) -> None:
        """The fetched shard was gathered; its copy above the home is dropped (memory holds only what is in
        use), unless `keep` (a backward gather) and the master is this very slot: then a host copy of an
        NVMe shard stays cached, within the host budget, for the step that reads it a few blocks later. A
        forward gather's host copy of an NVMe shard, where steps are deferred until the next gather (most often
        the copy the step wrote), holds the weights backward gathers again: it stays cached too, as a plain
        cached copy that a budget reclaims first."""
        key = self.key(flat, ShardKind.PARAM)
        p = self.placement
        from_host = p.param_home is Tier.NVME and p.gather_from is Tier.HOST
        kept = keep and p.master_is_param and from_host
        stepped = not keep and from_host and p.step_timing is StepTiming.BEFORE_NEXT_GATHER
        # A step a few blocks later reads it: kept from eviction by the read-ahead of the next blocks'
        # parameters. A step before the next forward's gather reads the last few kept only; those stay
        # as plain cached copies, which the read-ahead may take.
        self.tiers.release(key, p.gather_from, keep=kept and p.step_in_backward)
        if p.param_home is not Tier.DEVICE and not kept and not stepped:
            self.tiers.evict(key)

    def fetch_unsettled_param(self, flat: FlatParam) -> torch.Tensor:
        """This rank's parameter shard as it is, where gathers read it, without settling the update owed to it
        (a gradient replay needs the weights that update is computed from); `release_unsettled_param` after."""
        if self.placement.param_home is not self.placement.gather_from:
            self.param_bytes_fetched += flat.shard_numel * self.placement.compute_dtype.itemsize
        return self.tiers.fetch(self.key(flat, ShardKind.PARAM), self.placement.gather_from).wait()

    def prefetch_unsettled(self, flats: list[FlatParam], ahead: list[FlatParam]) -> None:
        """Start reading what a gradient replay of `flats` reads (their parameter shards as they are), what their
        owed steps read next (the optimizer state), then the parameter shards of `ahead` (the block replayed
        next) where their gradients are to be recomputed: the disk works through the replays' compute. NVMe
        parameter shards are read into host memory, where gathers read them or (a GPU) the copy to the device
        starts from."""
        p = self.placement
        params_read = p.param_home is Tier.NVME
        if params_read:
            self.tiers.prefetch([self.key(f, ShardKind.PARAM) for f in flats], Tier.HOST)
        self.prefetch_state([f for f in flats if f in self.records], with_grad=False, master=not p.master_is_param)
        if params_read:
            replayed = [f for f in ahead if f in self._replay_owed or f in self._replay_trials]
            self.tiers.prefetch([self.key(f, ShardKind.PARAM) for f in replayed], Tier.HOST)

    def release_unsettled_param(self, flat: FlatParam) -> None:
        """Done with `fetch_unsettled_param`'s shard: its copy stays cached (the step reads it next)."""
        self.tiers.release(self.key(flat, ShardKind.PARAM), self.placement.gather_from, keep=True)

    def read_ahead(self, flats: Iterable[FlatParam]) -> None:
        """Start reading NVMe parameter shards into host memory, in order, within the read-ahead cap."""
        if self.placement.param_home is not Tier.NVME:
            return
        keys, total = [], 0
        for flat in flats:
            if flat in self._owed:  # its bytes change before the gather: read them once they have
                break
            total += flat.shard_numel * self.placement.compute_dtype.itemsize
            if self.read_ahead_bytes is not None and total > self.read_ahead_bytes:
                break
            keys.append(self.key(flat, ShardKind.PARAM))
        self.tiers.prefetch(keys, Tier.HOST)
