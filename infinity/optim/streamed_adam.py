"""StreamedAdam: Adam whose fp32 masters, moments and gradients live on NVMe, stepped block by block.

The step streams each shard's state through host memory: reads for the next shards are issued
while the current one is stepped by the native Adam (read ahead), and its new state is written
back without waiting (write behind). At most `window` shards' state is held at a time, and the
store's host budget bounds what read-ahead adds, however large the model. Gradients are
accumulated into each shard's own gradient slot on NVMe, so they are never all in memory at once.

With `step_as_grads_arrive` (set by the engine when no global quantity — a clipping norm, an
overflow check — must be known first), a shard's final gradient is not written to NVMe at all: its
state is read ahead at once and the shard is stepped a few blocks later, while backward computes the
blocks before it, so the optimizer's I/O hides behind backward and the gradient round trip vanishes.
The step then only finishes the last few shards.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from infinity.optim.sharded_adam import ParamSink, ShardedAdam
from infinity.partition.flat_param import FlatParam
from infinity.storage import MoveHandle, TierStore, aligned_empty

STATE_NAMES = ("master", "exp_avg", "exp_avg_sq")


def state_key(name: str, flat: FlatParam) -> tuple[str, str]:
    return (flat.name, name)


class StreamedAdam(ShardedAdam):
    """ShardedAdam over NVMe-resident state; `ShardState` tensors are placeholders (empty)."""

    _masters_outlive_writes = True  # a master's host copy is released only once its shard's writes are done

    def __init__(
        self,
        groups: list[dict[str, Any]],
        adamw_mode: bool,
        param_sink: ParamSink,
        store: TierStore,
        window: int,
    ) -> None:
        self.store = store
        self.window = max(1, window)
        super().__init__(groups, adamw_mode, offloaded=True, param_sink=param_sink)
        self._grad_writes: deque[tuple[MoveHandle, torch.Tensor]] = deque()
        self._norm_sq: dict[FlatParam, float] = {}
        self.nvme_bytes = {"nvme->host": 0, "host->nvme": 0}  # optimizer state and gradients streamed
        self.step_as_grads_arrive = False
        self.stepped_in_backward = 0  # shards stepped while backward was still running (a counter)
        self._arrived: deque[tuple[FlatParam, torch.Tensor]] = deque()  # final gradients, state read ahead
        self._stepping: deque[tuple[FlatParam, list[MoveHandle], bool]] = deque()  # state writes in flight

    def add_shard(self, flat: FlatParam, master: torch.Tensor, param_shard: torch.Tensor | None) -> None:
        """Write the master shard, zero moments and a gradient slot to NVMe; nothing stays in memory."""
        zeros = torch.zeros_like(master)
        for name, value in (("master", master), ("exp_avg", zeros), ("exp_avg_sq", zeros), ("grad", zeros)):
            self.store.put(state_key(name, flat), value, "nvme").wait()
        super().add_shard(flat, torch.empty(0), param_shard)  # a distinct placeholder: torch dedups params

    # -- gradients -----------------------------------------------------------------------------

    def accumulate_grad(self, flat: FlatParam, shard_grad: torch.Tensor, final: bool = True) -> None:
        state = self.shard_states[flat]
        key = state_key("grad", flat)
        grad = shard_grad.to("cpu", dtype=torch.float32)
        self.grad_bytes_to_host += grad.numel() * grad.element_size()
        nbytes = grad.numel() * 4
        if final and self.step_as_grads_arrive:
            if state.has_grad:  # the earlier micro-batches' sum, from its NVMe slot
                self._finish_grad_writes()
                self.nvme_bytes["nvme->host"] += nbytes
                try:
                    grad = self.store.fetch(key, "host").wait().add(grad)
                finally:
                    self.store.release(key, "host")
                    self.store.evict(key)
            state.has_grad = True
            self._arrive(flat, grad)
            return
        self.nvme_bytes["host->nvme"] += nbytes
        if state.has_grad:
            self.nvme_bytes["nvme->host"] += nbytes
            held = self.store.fetch(key, "host").wait()
            try:
                held.add_(grad)
                self.store.write(key, held).wait()
                grad = held
                if final:
                    self._norm_sq[flat] = float(torch.linalg.vector_norm(held)) ** 2
            finally:
                self.store.release(key, "host")
        else:
            if final:
                self._norm_sq[flat] = float(torch.linalg.vector_norm(grad)) ** 2
            self._grad_writes.append((self.store.write(key, grad), grad))
            while len(self._grad_writes) > max(1, self.window // 2):  # as many as arrivals hold (budgets.py)
                self._grad_writes.popleft()[0].wait()
            state.has_grad = True

    def accumulate_param_grads(self, flat: FlatParam, final: bool = True) -> None:
        # The accumulator is on NVMe: stage the gradients in one flat first, 4 KiB-aligned on the host so
        # that it is written in place (an unaligned one would take a staging buffer as large again).
        out = aligned_empty(flat.padded_numel * 4).view(torch.float32) if flat.full.device.type == "cpu" else None
        full = flat.flat_grad(out)
        if full is not None:
            self.accumulate_grad(flat, full, final)

    def _arrive(self, flat: FlatParam, grad: torch.Tensor) -> None:
        """A final gradient: read the shard's state ahead now; step the shards that arrived a few blocks ago."""
        self.store.prefetch(self._keys(flat, with_grad=False), "host")
        self._arrived.append((flat, grad))
        # Half the window waits for its reads (they had a block of backward to arrive); the other half
        # of the window's host memory holds the stepped shards whose writes are still in flight.
        while len(self._arrived) > max(1, self.window // 2):
            self._step_arrived(*self._arrived.popleft(), grad_scale=1.0)
            self.stepped_in_backward += 1

    def _step_arrived(self, flat: FlatParam, grad: torch.Tensor, grad_scale: float) -> None:
        s = self.shard_states[flat]
        master, exp_avg, exp_avg_sq = self._fetch_state(flat, with_grad=False)
        s.step += 1
        s.stepped = True
        param_write = self._adam_native(flat, s.step, master, grad, exp_avg, exp_avg_sq, s.param_shard, grad_scale)
        self._write_state(flat, master, exp_avg, exp_avg_sq, param_write, with_grad=False)

    def _fetch_state(self, flat: FlatParam, with_grad: bool) -> list[torch.Tensor]:
        return [self.store.fetch(key, "host").wait() for key in self._keys(flat, with_grad)]

    def _write_state(self, flat: FlatParam, master, exp_avg, exp_avg_sq, param_write, with_grad: bool) -> None:
        """Write the new state behind (waited for only when `window` shards are in flight); the shard's
        parameter write (`param_write`, may be None) may read `master` and is waited for with them."""
        self.nvme_bytes["nvme->host"] += (3 + with_grad) * master.numel() * 4
        self.nvme_bytes["host->nvme"] += 3 * master.numel() * 4
        writes = [
            self.store.write(state_key(n, flat), t)
            for n, t in zip(STATE_NAMES, (master, exp_avg, exp_avg_sq), strict=True)
        ]
        if param_write is not None:
            writes.append(param_write)
        self._stepping.append((flat, writes, with_grad))
        # the shards read ahead on arrival share the window's host memory with those being written
        while len(self._stepping) >= max(1, self.window - len(self._arrived)):
            self._retire(*self._stepping.popleft())

    def _finish_grad_writes(self) -> None:
        while self._grad_writes:
            self._grad_writes.popleft()[0].wait()

    def local_grad_norm_sq(self) -> torch.Tensor:
        self._finish_grad_writes()
        return torch.tensor(
            sum(self._norm_sq.get(f, 0.0) for f, s in self.shard_states.items() if s.has_grad), dtype=torch.float64
        )

    @property
    def step_in_progress(self) -> bool:
        """Some shards were stepped (or are being) as their gradients arrived; `step()` finishes the rest."""
        return bool(self._arrived or self._stepping) or any(s.stepped for s in self.shard_states.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.refuse_mid_step("zero_grad")
        super().zero_grad(set_to_none)
        self._norm_sq.clear()

    # -- the step ------------------------------------------------------------------------------

    def _keys(self, flat: FlatParam, with_grad: bool = True) -> list[tuple[str, str]]:
        return [state_key(n, flat) for n in ((*STATE_NAMES, "grad") if with_grad else STATE_NAMES)]

    def _step_native(self, grad_scale: float) -> None:
        self._finish_grad_writes()
        while self._arrived:  # stepped as their gradients arrived, but for the last few
            self._step_arrived(*self._arrived.popleft(), grad_scale=grad_scale)
        todo = [f for f, s in self.shard_states.items() if s.has_grad and not s.stepped]
        for i, flat in enumerate(todo):
            # read ahead: the next shards' state comes in while this one is stepped
            self.store.prefetch([k for f in todo[i : i + self.window] for k in self._keys(f)], "host")
            master, exp_avg, exp_avg_sq, grad = self._fetch_state(flat, with_grad=True)
            s = self.shard_states[flat]
            s.step += 1
            param_write = self._adam_native(flat, s.step, master, grad, exp_avg, exp_avg_sq, s.param_shard, grad_scale)
            self._write_state(flat, master, exp_avg, exp_avg_sq, param_write, with_grad=True)
        while self._stepping:
            self._retire(*self._stepping.popleft())
        for s in self.shard_states.values():
            s.stepped = False
        self.finish_param_writes()

    def _retire(self, flat: FlatParam, writes: list[MoveHandle], with_grad: bool) -> None:
        for handle in writes:
            handle.wait()
        for key in self._keys(flat, with_grad):
            self.store.release(key, "host")
            self.store.evict(key)

    def _step_torch(self, grad_scale: float) -> None:  # pragma: no cover - NVMe state is always stepped natively
        raise RuntimeError("StreamedAdam steps natively on the host")

    # -- state access --------------------------------------------------------------------------

    def read_state(self, flat: FlatParam) -> dict[str, torch.Tensor]:
        self.refuse_mid_step("reading the optimizer state (a checkpoint, full weights)")
        out = {}
        for name in STATE_NAMES:
            key = state_key(name, flat)
            try:
                out[name] = self.store.fetch(key, "host").wait().clone()
            finally:
                self.store.release(key, "host")
        return out

    def load_state(self, flat: FlatParam, values: dict[str, torch.Tensor]) -> None:
        self.refuse_mid_step("loading optimizer state or weights")
        for name in STATE_NAMES:
            self.store.write(state_key(name, flat), values[name].to(torch.float32).contiguous()).wait()
