"""Collectives on flat 1-D buffers; with world size 1 they are local copies and need no process group.

Every collective names what it was moving when it fails, so a rank that died shows up as a clear
error on its peers (after the process group's timeout at worst), not a hang. Every collective also
checks that its tensors live on the group's device (NCCL: this rank's GPU; Gloo: the CPU), with one
rank too, so a tensor on the wrong side of the bus is an error naming it on a CPU-only machine as well.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from infinity.comm.buffers import CollectiveBuffers

# torch 2.13 renamed the flat-buffer collectives; older releases only have the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommError(RuntimeError):
    """A collective failed, typically because a peer rank died or timed out."""


class CommDeviceError(ValueError):
    """A collective was handed a tensor that does not live on the group's device."""


class _Work:
    """An async collective whose wait() raises CommError, like the synchronous calls."""

    def __init__(self, work, fail) -> None:
        self._work = work
        self._fail = fail

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def wait(self) -> None:
        try:
            self._work.wait()
        except Exception as exc:
            raise self._fail(exc) from exc


class _AllWorks:
    """Several async collectives seen as one work handle."""

    def __init__(self, works: list) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        for work in self._works:
            work.wait()


class _SummedOnWait:
    """Point-to-point sends and receives of a reduce-scatter. Gloo's point-to-point work reports completion
    only once waited for, and may be waited for only once: a thread waits for them in the background, so
    that `is_completed()` can be polled; `wait()` then adds what was received into this rank's slice (once)."""

    def __init__(self, works: list, mine: torch.Tensor, received: list[torch.Tensor], fail) -> None:
        self._mine = mine
        self._received = received
        self._fail = fail
        self._error: BaseException | None = None
        self._done = threading.Event()
        waiter = threading.Thread(target=self._wait_all, args=(works,), name="infinity-reduce-scatter", daemon=True)
        waiter.start()

    def _wait_all(self, works: list) -> None:
        try:
            while works:
                works.pop(0).wait()
        except BaseException as exc:  # re-raised by wait(), in the caller's thread
            self._error = exc
        finally:
            # a work holds its tensors: dropped before the caller can go on and lend the buffers again (a
            # buffer still held looks in use, and the pool would take fresh memory instead)
            works.clear()
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._fail(self._error) from self._error
        for buffer in self._received:
            self._mine.add_(buffer)
        self._received = []


@dataclass(frozen=True)
class CommGroup:
    """The data-parallel group: this rank, the world size, the torch process group (None if 1), the
    device every collective's tensors live on (`comm_device`), and the host memory its gathers and
    reductions reuse (`buffers`)."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None
    device: torch.device = torch.device("cpu")
    buffers: CollectiveBuffers = field(default_factory=CollectiveBuffers, compare=False, repr=False)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def _fail(self, op: str, what: str, exc: Exception) -> CommError:
        return CommError(
            f"rank {self.rank}/{self.world_size}: {op} of {what} failed ({exc}); "
            "a peer rank has probably died or is stuck: check the other ranks' logs"
        )

    def _check_device(self, op: str, what: str, **tensors: torch.Tensor) -> None:
        for role, tensor in tensors.items():
            if tensor.device != self.device:
                raise CommDeviceError(
                    f"rank {self.rank}/{self.world_size}: {op} of {what}: its {role} tensor is on {tensor.device}, "
                    f"but this group's collectives take tensors on {self.device}; move it there first "
                    f"(.to({str(self.device)!r}))"
                )

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, what: str, async_op: bool = False):
        """Fill `full` (world_size x shard.numel()) with every rank's shard, in rank order."""
        self._check_device("all-gather", what, output=full, input=shard)
        if full.numel() != shard.numel() * self.world_size:
            raise ValueError(
                f"rank {self.rank}/{self.world_size}: all-gather of {what}: the output holds {full.numel()} "
                f"elements, not {self.world_size} x {shard.numel()} (world size x shard)"
            )
        if not self.distributed:
            full.copy_(shard)
            return None
        try:
            if dist.get_backend(self.group) == "gloo":
                work = self._all_gather_by_broadcasts(full, shard, async_op)
            else:
                work = _all_gather_flat(full, shard, group=self.group, async_op=async_op)
        except Exception as exc:
            raise self._fail("all-gather", what, exc) from exc
        return _Work(work, lambda exc: self._fail("all-gather", what, exc)) if work is not None else None

    def _all_gather_by_broadcasts(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool):
        """Gloo's all-gather receives into a fresh buffer of the full size and then copies it into `full`
        (page faults and a copy per gather, on the cores that compute); a broadcast from each rank writes
        its slot of `full` in place, and each rank still receives every other rank's shard once."""
        n = shard.numel()
        mine = full.narrow(0, self.rank * n, n)
        if mine.data_ptr() != shard.data_ptr():
            mine.copy_(shard)
        works = [
            dist.broadcast(full.narrow(0, r * n, n), src=self._global_rank(r), group=self.group, async_op=async_op)
            for r in range(self.world_size)
        ]
        return _AllWorks(works) if async_op else None

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def reduce_scatter_sum(self, shard: torch.Tensor, full: torch.Tensor, what: str, async_op: bool = False):
        """Write into `shard` this rank's slice of the sum of `full` over ranks; a work handle if `async_op`
        (keep both buffers alive until it is waited for), else None."""
        self._check_device("reduce-scatter", what, output=shard, input=full)
        if not self.distributed:
            shard.copy_(full)
            return None
        try:
            work = _reduce_scatter_flat(shard, full, group=self.group, async_op=async_op)
        except Exception as exc:
            raise self._fail("reduce-scatter", what, exc) from exc
        return _Work(work, lambda exc: self._fail("reduce-scatter", what, exc)) if work is not None else None

    def reduce_scatter_in_background(self, full: torch.Tensor, what: str) -> tuple[torch.Tensor, object]:
        """Start summing `full` over ranks without waiting; (this rank's slice of the sum once the work
        handle is waited for, the handle). NCCL reduce-scatters into a new shard. Gloo's reduce-scatter does
        not progress until it is waited for: there each rank sends every peer that peer's slice (point to
        point, carried by Gloo's transport threads while backward goes on) and, when waited for, adds what it
        received into its own slice of `full`, which the shard is a view of: a reduce-scatter's bytes, half
        those of the all-reduce that would also run in the background."""
        self._check_device("reduce-scatter", what, input=full)
        shard_numel = full.numel() // self.world_size
        if full.numel() != shard_numel * self.world_size:
            raise ValueError(
                f"rank {self.rank}/{self.world_size}: reduce-scatter of {what}: the input holds {full.numel()} "
                f"elements, not a multiple of the world size"
            )
        if self.distributed and dist.get_backend(self.group) == "gloo":
            try:
                return self._reduce_scatter_by_sends(full, shard_numel, what)
            except Exception as exc:
                raise self._fail("reduce-scatter", what, exc) from exc
        shard = torch.empty(shard_numel, dtype=full.dtype, device=full.device)
        return shard, self.reduce_scatter_sum(shard, full, what, async_op=True)

    def _reduce_scatter_by_sends(self, full: torch.Tensor, n: int, what: str) -> tuple[torch.Tensor, _SummedOnWait]:
        works, received = [], []
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            works.append(dist.isend(full.narrow(0, peer * n, n), dst=self._global_rank(peer), group=self.group))
            buffer = self.buffers.take(n, full.dtype, full.device)
            works.append(dist.irecv(buffer, src=self._global_rank(peer), group=self.group))
            received.append(buffer)
        mine = full.narrow(0, self.rank * n, n)
        return mine, _SummedOnWait(works, mine, received, lambda exc: self._fail("reduce-scatter", what, exc))

    def all_reduce(self, tensor: torch.Tensor, what: str, op: str = "sum", async_op: bool = False):
        """In-place all-reduce with `op` in {'sum', 'max'}; returns `tensor`, or with `async_op` a work handle
        (None with one rank)."""
        self._check_device("all-reduce", what, buffer=tensor)
        if not self.distributed:
            return None if async_op else tensor
        red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        try:
            work = dist.all_reduce(tensor, op=red, group=self.group, async_op=async_op)
        except Exception as exc:
            raise self._fail("all-reduce", what, exc) from exc
        if async_op:
            return _Work(work, lambda exc: self._fail("all-reduce", what, exc))
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> torch.Tensor:
        self._check_device("broadcast", what, buffer=tensor)
        if self.distributed:
            try:
                dist.broadcast(tensor, src=src, group=self.group)
            except Exception as exc:
                raise self._fail("broadcast", what, exc) from exc
        return tensor

    def barrier(self, what: str) -> None:
        if self.distributed:
            try:
                dist.barrier(group=self.group)
            except Exception as exc:
                raise self._fail("barrier", what, exc) from exc
