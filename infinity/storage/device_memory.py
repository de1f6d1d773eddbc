"""The device tier's memory: CUDA memory on a GPU, plain CPU memory with its own budget otherwise.

Memory bound: bytes handed out and not yet released never exceed `budget_bytes`.
"""

from __future__ import annotations

import torch

from infinity.storage.budget import BudgetedAllocator


class DeviceMemory(BudgetedAllocator):
    """`acquire(n)` gives an uint8 tensor of n bytes on `device`, accounted against the budget. Thread-safe."""

    name = "device memory"

    def __init__(self, budget_bytes: int | None, device: torch.device, timeout_s: float = 300.0) -> None:
        super().__init__(budget_bytes, timeout_s)
        self.device = device
        # Copies onto the GPU run on a side stream; allocating there lets record_stream keep the
        # caching allocator from reusing a block while the consumer's stream still reads it.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._held: dict[int, int] = {}

    def _take(self, need: int) -> torch.Tensor | None:
        if not self._fits(need):
            return None
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                buf = torch.empty(need, dtype=torch.uint8, device=self.device)
        else:
            buf = torch.empty(need, dtype=torch.uint8, device=self.device)
        self._held[buf.data_ptr()] = need
        self._account(need)
        return buf

    def _give_back(self, buf: torch.Tensor) -> None:
        need = self._held.pop(buf.data_ptr(), None)
        if need is None:
            raise ValueError("release() of device memory this tier did not hand out (or released twice)")
        self.live_bytes -= need
