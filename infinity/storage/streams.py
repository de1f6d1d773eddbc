"""Copies between host memory and the device with explicit ordering: one copy stream, an event per copy.

A copy runs on the copy stream after the work it depends on (`after`: a `mark()` of the stream that
produced its source), and gives a `CopyDone` its consumers wait on: the compute stream
(`wait_on_current_stream`, no CPU block) before a kernel reads what was copied, the CPU (`synchronize`)
before host code reads it or reuses the source. Device tensors a copy touches are recorded on the copy
stream, so the caching allocator never hands their memory to another stream while the copy runs; a host
buffer a copy reads is the caller's to keep until `synchronize` (host memory has no allocator to tell).

Without CUDA a copy runs at once on the calling thread and every wait returns at once, unless
`simulate_async_copies` is on (tests): then a thread plays the copy stream, running copies in order after
a delay, and each wait blocks until its copy is done, so a wait missing from a caller shows as wrong bytes
on a CPU-only machine too.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from infinity.storage.buffer_pool import copy_bytes


class CopyDone:
    """The completion of one copy (or of a stream's work up to a point)."""

    __slots__ = ("_event", "_flag")

    def __init__(self, event: torch.cuda.Event | None = None, flag: threading.Event | None = None) -> None:
        self._event = event  # CUDA
        self._flag = flag  # a simulated copy stream

    def done(self) -> bool:
        if self._event is not None:
            return self._event.query()
        return self._flag is None or self._flag.is_set()

    def wait_on_current_stream(self) -> None:
        """Work queued on the current (compute) stream from now on runs after the copy; the CPU goes on."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)  # each rank's compute device is the current one
        elif self._flag is not None:
            self._flag.wait()  # the CPU is the compute stream

    def synchronize(self) -> None:
        """Return once the copy is complete."""
        if self._event is not None:
            self._event.synchronize()
        elif self._flag is not None:
            self._flag.wait()


DONE = CopyDone()  # what a copy that ran at once gives

_simulated_delay_s: float | None = None


@contextmanager
def simulate_async_copies(delay_s: float) -> Iterator[None]:
    """For tests on a CPU-only machine: copy streams made inside run their copies on a thread, `delay_s`
    late, like a GPU's copy engine running behind the CPU."""
    global _simulated_delay_s
    before, _simulated_delay_s = _simulated_delay_s, delay_s
    try:
        yield
    finally:
        _simulated_delay_s = before


class CopyStream:
    """The copy stream of one device: `copy` on it, `mark` the caller's stream; see the module docstring."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        """`stream`: the CUDA stream to copy on (a new one if None)."""
        self.device = device
        self.stream = stream or (torch.cuda.Stream(device) if device.type == "cuda" else None)
        self._simulated = _SimulatedStream(_simulated_delay_s) if self.stream is None and _simulated_delay_s else None

    def mark(self) -> CopyDone | None:
        """The caller's (compute) stream's work queued so far, for a copy to wait on; None where the CPU
        computes (its work is done when it returns)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return CopyDone(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: CopyDone | None = None) -> CopyDone:
        """Copy `src` into `dst` (same dtype and shape) on the copy stream once `after` is done."""
        if self.stream is not None and (dst.is_cuda or src.is_cuda):
            with torch.cuda.stream(self.stream):
                if after is not None and after._event is not None:
                    self.stream.wait_event(after._event)
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self.stream)
            return CopyDone(event)
        if self._simulated is not None:
            return self._simulated.submit(dst, src, after)
        if after is not None:
            after.synchronize()
        _copy_now(dst, src)
        return DONE

    def close(self) -> None:
        """Finish the copies in flight (a simulated stream's thread ends)."""
        if self._simulated is not None:
            self._simulated.close()
        elif self.stream is not None:
            self.stream.synchronize()


def _copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous():
        copy_bytes(dst, src)
    else:
        dst.copy_(src)


class _SimulatedStream:
    """A thread running copies in submission order, each `delay_s` after it was submitted."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="infinity-simulated-copy-stream", daemon=True)
        self._thread.start()

    def submit(self, dst: torch.Tensor, src: torch.Tensor, after: CopyDone | None) -> CopyDone:
        flag = threading.Event()
        self._jobs.put((time.monotonic() + self.delay_s, dst, src, after, flag))
        return CopyDone(flag=flag)

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            due, dst, src, after, flag = job
            if after is not None:
                after.synchronize()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                _copy_now(dst, src)
            finally:
                job = dst = src = None  # the copy is done: `src` may be reused, so hold none of it
                flag.set()
