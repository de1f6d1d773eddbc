"""Bytes crossing between device memory and the host for the shard store: gradients down, new weights up.

Used where the placement keeps the device apart from the host (`Placement.device_apart`). Gradients
cross in the compute dtype (cast on the device, half the bytes of fp32 for bf16/fp16), into pinned
buffers from one pool, on the tier store's copy stream after the compute stream's work; host code reads
a buffer only after `StagedCopy.wait`. New weights stepped on the host go up from a pinned buffer of the
same pool; the compute stream waits for that copy, and the buffer returns to the pool once it is done.

Memory bound (pinned host): one buffer of a shard in the compute dtype per copy not yet released; the
store releases gradients within `ShardStore.grad_staging_bytes`, weights when the optimizer finishes a
given-back shard (at most its window at once). These buffers sit beside the tiers: `host_budget_bytes`
bounds what the tier store holds, not them (as the device's working set sits beside `device_budget_bytes`).
"""

from __future__ import annotations

import torch

from infinity.storage import BufferPool
from infinity.storage.streams import CopyDone, CopyStream


class StagedCopy:
    """A tensor's bytes on their way into (or out of) a pinned pool buffer."""

    __slots__ = ("host", "done", "_buf")

    def __init__(self, host: torch.Tensor, done: CopyDone, buf: torch.Tensor) -> None:
        self.host = host  # a view of the pool buffer: read it after wait(), never after release
        self.done = done
        self._buf = buf

    def wait(self) -> torch.Tensor:
        """The host buffer, once the copy is complete."""
        self.done.synchronize()
        return self.host


class DeviceHostCopies:
    """Pinned staging and ordered copies between the compute device and host memory; counts the bytes
    gradients carry to the host (`grad_bytes_to_host`)."""

    def __init__(self, copies: CopyStream, compute_dtype: torch.dtype) -> None:
        self.copies = copies
        self.compute_dtype = compute_dtype
        self.pool = BufferPool(None, pin_memory=True)  # pinned where CUDA is; grows to the bound, then reused
        self.grad_bytes_to_host = 0

    def buffer(self, numel: int, dtype: torch.dtype) -> StagedCopy:
        """An empty pinned buffer of `numel` x `dtype` (for host code to fill, then `to_device`)."""
        buf = self.pool.acquire(numel * dtype.itemsize)
        return StagedCopy(buf[: numel * dtype.itemsize].view(dtype), CopyDone(), buf)

    def grad_to_host(self, grad: torch.Tensor) -> StagedCopy:
        """Start copying a gradient (fp32, in device memory, written by the compute stream) into a pinned
        buffer in the compute dtype; `wait()` before reading it, `release` after."""
        low = grad.detach().reshape(-1).to(self.compute_dtype)  # on the compute stream: half the bytes to copy
        staged = self.buffer(low.numel(), low.dtype)
        staged.done = self.copies.copy(staged.host, low, after=self.copies.mark())
        self.grad_bytes_to_host += low.numel() * low.element_size()
        return staged

    def to_device(self, dst: torch.Tensor, staged: StagedCopy) -> CopyDone:
        """Start copying the filled buffer into `dst` (device memory); the compute stream waits for it before
        its next work. `release` the buffer only after the returned copy is done."""
        staged.done = self.copies.copy(dst, staged.host, after=self.copies.mark())
        staged.done.wait_on_current_stream()
        return staged.done

    def release(self, staged: StagedCopy) -> None:
        """Give the buffer back to the pool, once its copy is done."""
        staged.done.synchronize()
        self.pool.release(staged._buf)

    def close(self) -> None:
        """Drop the pool's buffers (the copy stream is the tier store's, closed with it)."""
        self.pool.close()
