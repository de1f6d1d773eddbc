"""Where each FlatParam's compute-dtype shard lives between uses, and bringing it to the device.

`ShardPlacement` is the engine's single point of contact with the storage layer for parameter
shards: the home tier comes from `offload_param.device` (none -> device, cpu -> host), and moving
a shard there and back is the storage layer's job.
"""

from __future__ import annotations

import torch

from infinity.partition.flat_param import FlatParam


class ShardPlacement:
    """Keeps every FlatParam's shard on its home tier; `acquire` returns it on the compute device."""

    def __init__(self, home_tier: str, device: torch.device, pin_memory: bool) -> None:
        self.home_tier = home_tier
        self.device = device
        self.pin_memory = pin_memory and device.type == "cuda"
        self._home: dict[FlatParam, torch.Tensor] = {}
        self._on_device: dict[FlatParam, torch.Tensor] = {}
        self.bytes_moved: dict[str, int] = {}  # "from->to" tier pair -> bytes

    def put(self, flat: FlatParam, shard: torch.Tensor) -> None:
        """Store `shard` (compute dtype) as `flat`'s shard on its home tier."""
        if self.home_tier == "device":
            home = shard.to(self.device, copy=True)
        else:
            home = torch.empty(shard.numel(), dtype=shard.dtype, pin_memory=self.pin_memory)
            home.copy_(shard)
        self._home[flat] = home

    def home(self, flat: FlatParam) -> torch.Tensor:
        """The shard where it lives; the optimizer writes new weights into it in place."""
        return self._home[flat]

    def acquire(self, flat: FlatParam) -> torch.Tensor:
        home = self._home[flat]
        if self.home_tier == "device":
            return home
        shard = home.to(self.device, non_blocking=True, copy=True)
        pair = f"{self.home_tier}->device"
        self.bytes_moved[pair] = self.bytes_moved.get(pair, 0) + shard.numel() * shard.element_size()
        self._on_device[flat] = shard
        return shard

    def release(self, flat: FlatParam) -> None:
        self._on_device.pop(flat, None)
