"""CollectiveBuffers: host memory for gathered flats and gradient reductions, kept and reused.

Every gather fills a block's flat and every reduction fills an input and receive buffers, a block at a
time. Taken from malloc and given back each time, that memory keeps going back to the OS and the kernel
zeroes it again on first touch: two ranks training the 110M GPT in fp32 on two cores took 40,000-110,000
minor page faults per rank and step that way (DDP: up to about 60,000). Kept here, each buffer is touched once.
The pool holds at most what was in use at once (the gather window, the reductions in flight, and the
gradient shards a deferred NVMe step holds in host memory, copied out of their reductions).

Two ways to borrow: `fill`/`drain` move a buffer's memory into a flat's own storage and back (the
storage object stays the one autograd's saved views point at), and `take` lends a tensor on a buffer
that is free again once no tensor shares its storage (a view kept by whoever summed it, a collective
still sending it, an NVMe write still reading it), so a caller that keeps what it was given never sees
it overwritten. `take(align=4096)` lends a tensor that direct I/O can write in place (`aligned_view`).
"""

from __future__ import annotations

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _private_apis_behave() -> bool:
    """Both private torch APIs the pool relies on exist and do what it assumes, checked on a few bytes: a
    storage's user count sees a tensor on it, and `_swap_data_ptr_` moves memory and size together. A
    torch where either changed gets no pool (a wrong count would lend memory still in use)."""
    if _use_count is None or not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return False
    holder = torch.UntypedStorage(8)
    alone = _use_count(holder._cdata)
    lent = torch.empty(0, dtype=torch.uint8).set_(holder, 0, (8,))
    shared = _use_count(holder._cdata)
    del lent
    empty = torch.UntypedStorage(0)
    address = holder.data_ptr()
    empty._swap_data_ptr_(holder)
    moved = empty.nbytes() == 8 and empty.data_ptr() == address and holder.nbytes() == 0
    return alone == 1 and shared == 2 and _use_count(empty._cdata) == 1 and moved


_APIS_BEHAVE = _private_apis_behave()


def _unused(holder: torch.UntypedStorage) -> bool:
    """Nothing but the pool holds `holder`."""
    return _use_count(holder._cdata) == 1


class CollectiveBuffers:
    """Buffers by size in bytes, for host memory only (a GPU's caching allocator reuses memory already)."""

    def __init__(self) -> None:
        self.enabled = _APIS_BEHAVE
        # `take` keeps at most this many buffers of its own (None: as many as were lent at once, shared
        # with the gathers' buffers)
        self.lend_limit: int | None = None
        self._holders: list[torch.UntypedStorage] = []
        self._lent: list[torch.UntypedStorage] = []  # `take`'s own, under a `lend_limit`, oldest first
        self._filled: dict[int, int] = {}  # storages `fill` gave memory to and `drain` has not taken back, by size

    def _reuses(self, device: torch.device) -> bool:
        return self.enabled and device.type == "cpu"

    def _free_holder(self, nbytes: int) -> torch.UntypedStorage | None:
        for holder in self._holders:
            if holder.nbytes() == nbytes and _unused(holder):
                return holder
        return None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, align: int = 1) -> torch.Tensor:
        """A flat tensor of `numel` elements (contents undefined), on a buffer nobody holds if there is one.
        With `align` > 1 (host memory) it starts on an `align`-byte boundary and its storage runs on to the
        next boundary past its end, so that direct I/O reads or writes it in place."""
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        nbytes = numel * dtype.itemsize
        if align > 1:  # room for the skip to the boundary and for the padding after the end
            nbytes = -(-nbytes // align) * align + align
        holders = self._holders if self.lend_limit is None else self._lent
        holder = None
        if self._reuses(device):
            holder = self._free_holder(nbytes) if self.lend_limit is None else self._free_fitting(nbytes)
        if holder is None:
            holder = torch.UntypedStorage(nbytes, device=device)
            if self._reuses(device) and self.lend_limit != 0:
                holders.append(holder)
        skip = -holder.data_ptr() % align // dtype.itemsize
        lent = torch.empty(0, dtype=dtype, device=device).set_(holder, skip, (numel,))
        if self.lend_limit is not None:  # (`lent` holds its buffer now: only others can go)
            self._let_go_of_lent(self.lend_limit)
        return lent

    def _free_fitting(self, nbytes: int) -> torch.UntypedStorage | None:
        """The smallest of `take`'s own buffers that nobody holds and that holds `nbytes` but not twice as
        much: under a limit a few buffers serve flats of several sizes (a block's attention and MLP pieces),
        while a small request (a reduction's received shard) does not tie up a whole flat's buffer."""
        free = [h for h in self._lent if nbytes <= h.nbytes() <= 2 * nbytes and _unused(h)]
        return min(free, key=lambda h: h.nbytes(), default=None)

    def _let_go_of_lent(self, keep: int) -> None:
        """Drop `take`'s own buffers that nobody holds, oldest first, until at most `keep` are left."""
        for holder in [h for h in self._lent if _unused(h)][: max(0, len(self._lent) - keep)]:
            self._lent.remove(holder)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty `storage` `nbytes` of memory (contents undefined): a kept buffer's, else new."""
        if storage.nbytes() != 0:
            raise ValueError(f"fill takes an empty storage, not one of {storage.nbytes()} bytes")
        if not self._reuses(storage.device):
            storage.resize_(nbytes)
            return
        self._filled[nbytes] = self._filled.get(nbytes, 0) + 1
        holder = self._free_holder(nbytes)
        if holder is None:
            storage.resize_(nbytes)
            return
        self._holders.remove(holder)
        storage._swap_data_ptr_(holder)

    def drain(self, storage: torch.UntypedStorage) -> None:
        """Take `storage`'s memory back into the pool if `fill` gave it (else free it: a flat's memory from
        before its first gather); `storage` is left empty."""
        nbytes = storage.nbytes()
        if not self._reuses(storage.device) or not self._filled.get(nbytes):
            storage.resize_(0)
            return
        self._filled[nbytes] -= 1
        holder = torch.UntypedStorage(0, device=storage.device)
        holder._swap_data_ptr_(storage)
        self._holders.append(holder)

    def clear(self) -> None:
        """Let every kept buffer go (those lent out stay with their borrowers, and are freed when drained)."""
        self._holders = []
        self._lent = []
        self._filled = {}

    def stop_keeping(self) -> None:
        """From now on every buffer comes from malloc and goes back to it."""
        self.enabled = False
        self.clear()

    def limit_lending(self, kept: int) -> None:
        """From now on (before the first gather) `take` keeps at most `kept` buffers of its own, the latest
        lent (0: it lends fresh memory, freed when dropped), apart from the gathers' buffers, which `fill`
        and `drain` still reuse. More are kept only while more are lent at once; a buffer beyond the limit
        goes at the first `take` after it is dropped. For a run whose host memory is the constraint: the
        gather window and the gradients in flight are in its plan (the compute's working set), while an
        unlimited pool would keep, between steps, as many buffers as were ever lent at once."""
        self.lend_limit = kept
        self.clear()

    @property
    def kept_bytes(self) -> int:
        """Bytes the pool keeps, lent out by `take` or not."""
        return sum(h.nbytes() for h in (*self._holders, *self._lent))
