"""What an engine reports about its run (DeepSpeed's getters and infinity's byte and wait counters), read
without changing anything: a mixin of `InfinityEngine`, kept apart from the training wiring."""

from __future__ import annotations


class EngineReadouts:
    """The read-only half of the engine's API; see the module docstring."""

    def get_lr(self) -> list[float]:
        """Each param group's learning rate now (the client optimizer's, where it sets them)."""
        if self._client_is_truth:
            self._sync_hyperparameters(into_client=False)
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """DeepSpeed's: the global gradient norm of the last step (unscaled), where clipping or fp16 took it."""
        return self.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for an fp16 overflow."""
        return self.loss_scaler.skipped_steps

    @property
    def bytes_moved(self) -> dict[str, int]:
        """Bytes that moved between tiers since initialization, per "from->to" pair: parameter shards,
        optimizer state and gradients as the store moved them (cache hits move nothing), and gradients
        copied off the device."""
        moved = dict(self.moves.bytes)
        if self.shards.grad_bytes_to_host:
            moved["device->host"] = moved.get("device->host", 0) + self.shards.grad_bytes_to_host
        return moved

    @property
    def kept_buffer_bytes(self) -> int:
        """Host memory kept between uses for gathers, gradient reductions and held gradients, lent out or not
        (`comm.buffers`: under an explicit `host_budget_bytes`, the gathers' and a few gradient flats)."""
        return self.comm.buffers.kept_bytes

    @property
    def stall_s(self) -> float:
        """Seconds compute waited for a block's weights to arrive."""
        return self.scheduler.stall_s
