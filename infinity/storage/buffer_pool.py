"""Host buffers aligned to 4 KiB for direct I/O, carved from slabs that are allocated once and reused.

Memory bound: the slabs together never exceed `budget_bytes`; every buffer is rounded up to 4 KiB
and counted whole. A request that does not fit waits for a buffer to come back (see `budget`).
Slabs are pinned (page-locked) when CUDA is present and `pin_memory` is asked for, plain otherwise.
"""

from __future__ import annotations

import functools

import torch

from infinity.storage.budget import BudgetedAllocator
from infinity.storage.ranges import RangeAllocator

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def aligned_empty(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose data starts on a 4 KiB boundary (no copy, a slice).

    Its storage always extends to the next 4 KiB boundary past `nbytes`, so direct I/O can use it in
    place (`aligned_view`) wherever the allocator happened to place it.
    """
    # round_up(nbytes) after the aligned start, whatever the skip (up to ALIGN - 1 bytes) turns out to be
    raw = torch.empty(round_up(nbytes) + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + nbytes]


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of contiguous `src` into `dst` (same byte length).

    Between CPU tensors: one memcpy, GIL released, on the calling thread only (torch's copy_ would
    start an OpenMP team that competes with the I/O threads); otherwise torch's copy_.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous() and src.is_contiguous():
        nbytes = src.numel() * src.element_size()
        if dst.numel() * dst.element_size() != nbytes:
            raise ValueError(f"copy_bytes: {nbytes} bytes into {dst.numel() * dst.element_size()}")
        _native().aio.copy(dst.data_ptr(), src.data_ptr(), nbytes)
    else:
        dst.view(torch.uint8).copy_(src.view(torch.uint8), non_blocking=False)


def aligned_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """`tensor`'s bytes padded to 4 KiB as a uint8 view, when direct I/O can use them in place, else None.

    That needs a contiguous CPU tensor starting on a 4 KiB boundary whose storage covers the padding.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.data_ptr() % ALIGN:
        return None
    offset = tensor.storage_offset() * tensor.element_size()
    padded = round_up(tensor.numel() * tensor.element_size())
    storage = tensor.untyped_storage()
    if storage.nbytes() - offset < padded:
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (padded,))


@functools.cache
def _native():
    from infinity._native_loader import load_native

    return load_native()


class _Slab:
    def __init__(self, nbytes: int, pin_memory: bool) -> None:
        self.tensor = aligned_empty(nbytes, pin_memory)
        self.ranges = RangeAllocator(nbytes)


class BufferPool(BudgetedAllocator):
    """Aligned uint8 host buffers: `acquire(n)` gives a tensor of round_up(n, 4096) bytes, `release` returns it.

    Slabs of `slab_bytes` (or one request's size, if larger) are added while the budget allows and
    kept until `close()`; when the rest of the budget is too small for a new slab, wholly free slabs
    are given back first so their bytes can be re-carved. Thread-safe.
    """

    name = "host buffer pool"

    def __init__(
        self,
        budget_bytes: int | None,
        pin_memory: bool = False,
        slab_bytes: int = 64 << 20,
        timeout_s: float = 300.0,
    ) -> None:
        super().__init__(None if budget_bytes is None else budget_bytes // ALIGN * ALIGN, timeout_s)
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.slab_bytes = round_up(slab_bytes)
        self.slab_total_bytes = 0
        self._slabs: list[_Slab] = []
        self._held: dict[int, tuple[_Slab, int, int]] = {}  # data_ptr -> (slab, offset, nbytes)
        self._closed = False

    def close(self) -> None:
        """Drop every slab; buffers still held stay valid as tensors but are no longer pooled (releasing one
        after close() does nothing)."""
        with self._cond:
            self._closed = True
            self._slabs.clear()
            self._held.clear()
            self.slab_total_bytes = 0
            self.live_bytes = 0

    def _footprint(self, nbytes: int) -> int:
        return round_up(max(nbytes, 1))

    def _take(self, need: int) -> torch.Tensor | None:
        for slab in self._slabs:
            offset = slab.ranges.alloc(need)
            if offset is not None:
                return self._hand_out(slab, offset, need)
        room = None if self.budget_bytes is None else self.budget_bytes - self.slab_total_bytes
        if room is not None and room < need:
            for slab in [s for s in self._slabs if s.ranges.used == 0]:
                self._slabs.remove(slab)
                self.slab_total_bytes -= slab.ranges.size
                room += slab.ranges.size
            if room < need:
                return None
        size = max(self.slab_bytes, need) if room is None else min(max(self.slab_bytes, need), room)
        slab = _Slab(size, self.pin_memory)
        self._slabs.append(slab)
        self.slab_total_bytes += size
        return self._hand_out(slab, slab.ranges.alloc(need), need)

    def _shortfall(self, need: int) -> str:
        if self.budget_bytes is None or self.live_bytes + need > self.budget_bytes:
            return ""
        largest = max((s.ranges.largest_free() for s in self._slabs), default=0)
        unslabbed = self.budget_bytes - self.slab_total_bytes
        return (
            f" (the free bytes are split: the longest free range is {max(largest, unslabbed)} bytes; buffers held"
            " for good, such as host-home shards, sit between them: a larger host budget leaves room)"
        )

    def _hand_out(self, slab: _Slab, offset: int, need: int) -> torch.Tensor:
        buf = slab.tensor[offset : offset + need]
        self._held[buf.data_ptr()] = (slab, offset, need)
        self._account(need)
        return buf

    def _give_back(self, buf: torch.Tensor) -> None:
        entry = self._held.pop(buf.data_ptr(), None)
        if entry is None and self._closed:
            return  # handed out before close(), which dropped its slab
        if entry is None:
            raise ValueError("release() of a buffer this pool did not hand out (or released twice)")
        slab, offset, need = entry
        slab.ranges.free(offset, need)
        self.live_bytes -= need
