"""FlatParam: some parameters of one block as one flat buffer, of which each rank holds a 1/N shard.

The full (unsharded) buffer's storage is filled with memory when gathered and emptied when resharded
(`CollectiveBuffers`: kept for the next gather, in host memory); the parameters are views into it while
unsharded and empty tensors otherwise. Tensors autograd saved during forward keep pointing at the same
storage, so refilling it before backward makes them valid again (the technique FSDP1's flat parameter
uses).

A flat is in one `FlatState`: SHARDED (no full buffer), UNSHARDED (gathered until resharded), or
RESIDENT: the full buffer is permanent memory the shard store owns (one rank whose shard lives where
the compute reads it: the shard is the whole flat), so unsharding or resharding it moves nothing.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import nn

from infinity.comm import CommGroup

# Each rank's shard is a multiple of this many elements: 4 KiB of fp32, so shards of every dtype stay
# aligned for direct I/O and divide evenly by the world size.
SHARD_ALIGN_ELEMS = 1024


class FlatState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"
    RESIDENT = "resident"


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives: the modules and attribute names using it, and its range in the flat."""

    fqn: str
    uses: tuple[tuple[nn.Module, str], ...]
    shape: torch.Size
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FlatParam:
    """A flat, padded, sharded buffer for parameters that share a block, a param group and trainability."""

    def __init__(
        self,
        name: str,
        params: list[tuple[str, nn.Parameter, tuple[tuple[nn.Module, str], ...]]],
        compute_dtype: torch.dtype,
        device: torch.device,
        comm: CommGroup,
        group_index: int | None,
        persistent: bool,
    ) -> None:
        self.name = name
        self.comm = comm
        self.group_index = group_index  # None: frozen parameters, never stepped
        self.persistent = persistent
        self.params = [p for _, p, _ in params]
        self.requires_grad = group_index is not None
        slots, offset = [], 0
        for fqn, p, uses in params:
            slots.append(ParamSlot(fqn, uses, p.shape, offset))
            offset += p.numel()
        self.slots: tuple[ParamSlot, ...] = tuple(slots)
        self.numel = offset
        self.shard_numel = self.shard_elems(offset, comm.world_size)
        self.padded_numel = self.shard_numel * comm.world_size
        self.full = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
        self._empty = torch.empty(0, dtype=compute_dtype, device=device)
        self.state = FlatState.UNSHARDED  # the parameters' own values until the engine shards them

    @staticmethod
    def shard_elems(numel: int, world_size: int) -> int:
        """Each rank's shard of a flat of `numel` elements: 1/world_size, padded to SHARD_ALIGN_ELEMS."""
        return math.ceil(math.ceil(numel / world_size) / SHARD_ALIGN_ELEMS) * SHARD_ALIGN_ELEMS

    @property
    def unsharded(self) -> bool:
        """The full buffer holds the weights (unsharded or resident)."""
        return self.state is not FlatState.SHARDED

    @property
    def resident(self) -> bool:
        return self.state is FlatState.RESIDENT

    @property
    def shard_range(self) -> tuple[int, int]:
        start = self.comm.rank * self.shard_numel
        return start, start + self.shard_numel

    def initial_full_fp32(self) -> torch.Tensor:
        """The parameters' current values flattened to fp32 (padding zero), identical on every rank."""
        flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.full.device)
        for slot, p in zip(self.slots, self.params, strict=True):
            flat[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
        # Ranks may have built their models from different seeds: rank 0's weights win.
        self.comm.broadcast(flat, 0, f"initial weights of {self.name}")
        return flat

    def install_views(self, full: torch.Tensor | None = None) -> None:
        """Point every parameter at its range of the (allocated) full buffer, or of `full` (a copy of it)."""
        full = self.full if full is None else full
        for slot, p in zip(self.slots, self.params, strict=True):
            p.data = full[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def restore_resident_views(self) -> None:
        """Point a resident flat's parameters at its buffer again where the model replaced their data (a module
        casting its own weights in forward, as a router's `self.to(torch.float32)`): they would keep reading
        that copy while the steps update the buffer."""
        if self.state is FlatState.RESIDENT:
            base = self.full.untyped_storage().data_ptr()
            if any(p.untyped_storage().data_ptr() != base for p in self.params):
                self.install_views()

    def clear_views(self) -> None:
        """Point every parameter at an empty tensor again (after `install_views` of a copy, on a sharded flat)."""
        for p in self.params:
            p.data = self._empty

    def make_resident(self, full: torch.Tensor) -> None:
        """Make `full` (the whole flat in the compute dtype, memory the compute reads, owned by the shard
        store) the parameters' permanent storage: from now on the flat is always unsharded."""
        if full.numel() != self.padded_numel or full.dtype != self.full.dtype:
            raise ValueError(f"{self.name}: a resident buffer must hold the whole flat in {self.full.dtype}")
        self.full = full
        self.install_views()
        self.state = FlatState.RESIDENT

    def unshard(self, shard: torch.Tensor, async_op: bool = False):
        """Allocate the full buffer and all-gather every rank's shard into it (one rank: a copy); returns the
        collective's work handle when `async_op` (None when it completed already)."""
        if self.state is FlatState.RESIDENT:
            raise RuntimeError(f"{self.name} is resident: there is nothing to gather")
        if self.state is FlatState.SHARDED:
            self.comm.buffers.fill(self.full.untyped_storage(), self.padded_numel * self.full.element_size())
            self.install_views()
            self.state = FlatState.UNSHARDED
        with torch.no_grad():
            return self.comm.all_gather(self.full, shard, f"parameters of {self.name}", async_op=async_op)

    def reshard(self) -> None:
        """Free the full buffer's memory; parameters become empty tensors until the next unshard. A resident
        flat keeps its buffer."""
        if self.state is not FlatState.UNSHARDED:
            return
        for p in self.params:
            p.data = self._empty
        self.comm.buffers.drain(self.full.untyped_storage())
        self.state = FlatState.SHARDED

    def flat_grad(self, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The parameters' gradients in one padded buffer (zeros where a parameter has none): `out` if given
        (any dtype), else a new fp32 one; None when no parameter has a gradient."""
        if out is None:
            out = torch.empty(self.padded_numel, dtype=torch.float32, device=self.full.device)
        return out if self.grads_into(out, accumulate=False) else None

    @torch.no_grad()
    def grads_into(self, out: torch.Tensor, accumulate: bool) -> bool:
        """Write (or with `accumulate`, add) the parameters' gradients into the padded flat `out`, in one
        pass; returns False, touching nothing, when no parameter has a gradient. A gradient that is its piece of
        `out` already (made there) is left as it is."""
        if not any(p.grad is not None for p in self.params):
            return False
        for slot, p in zip(self.slots, self.params, strict=True):
            piece = out[slot.offset : slot.offset + slot.numel]
            if p.grad is None:
                if not accumulate:
                    piece.zero_()
            elif not accumulate and _is_piece(p.grad, piece):
                continue
            elif accumulate:
                piece.add_(p.grad.reshape(-1))
            else:
                piece.copy_(p.grad.reshape(-1))
        if not accumulate:
            out[self.numel :].zero_()  # the padding
        return True

    def grad_presence(self) -> tuple[bool, ...]:
        """Which parameters have a gradient, in slot order."""
        return tuple(p.grad is not None for p in self.params)

    def grads(self) -> list[torch.Tensor | None]:
        """The parameters' gradients, in slot order (None where a parameter has none)."""
        return [p.grad for p in self.params]

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a full flat buffer (any dtype) into tensors keyed by parameter fqn."""
        return {s.fqn: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots}


def _is_piece(grad: torch.Tensor, piece: torch.Tensor) -> bool:
    """Whether `grad` is the memory of the flat `piece` (as many elements, contiguous, at its address)."""
    return (
        grad.is_contiguous()
        and grad.numel() == piece.numel()
        and grad.dtype == piece.dtype
        and grad.device == piece.device
        and grad.data_ptr() == piece.data_ptr()
    )
