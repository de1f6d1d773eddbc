"""Where each FlatParam's compute-dtype shard lives between uses, and bringing it to the device.

`ShardPlacement` is the engine's single point of contact with the storage layer for parameter
shards: each shard is a key in the `TierStore` whose home tier comes from `offload_param.device`
(none -> device, cpu -> host, nvme -> nvme). A gather fetches the shard to the device (on a CPU-only
machine, to host memory: the compute's own) and releases it after the all-gather; the copies above
the home are evicted then, so nothing stale survives an optimizer step and device memory holds only
the blocks in use or prefetched.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from infinity.partition.flat_param import FlatParam
from infinity.storage import FetchHandle, MoveHandle, TierStore


def param_key(flat: FlatParam) -> tuple[str, str]:
    return (flat.name, "param")  # block first: the profiler names a move's block by the key's first item


class ShardPlacement:
    """Keeps every FlatParam's shard on its home tier; `acquire` returns it on the compute device."""

    def __init__(
        self, store: TierStore, home_tier: str, compute_reads_host: bool = False, read_ahead_bytes: int | None = None
    ) -> None:
        self.store = store
        self.home_tier = home_tier
        self.read_ahead_bytes = read_ahead_bytes  # NVMe shards read ahead into host memory at most; None: no cap
        # Where a gather reads the shard from. The device, unless the compute runs on the CPU: then host
        # memory is the compute's own and a further "device" copy would only cost a memcpy.
        self.fetch_tier = "host" if compute_reads_host and home_tier != "device" else "device"
        self._home: dict[FlatParam, torch.Tensor] = {}
        self.bytes_moved: dict[str, int] = {}  # "from->to" tier pair -> bytes

    def put(self, flat: FlatParam, shard: torch.Tensor) -> None:
        """Store `shard` (compute dtype) as `flat`'s shard on its home tier."""
        key = param_key(flat)
        self.store.put(key, shard, self.home_tier).wait()
        if self.home_tier != "nvme":  # home copies in memory are permanent: keep a handle on them
            self._home[flat] = self.store.fetch(key, self.home_tier).wait()
            self.store.release(key, self.home_tier)

    def home(self, flat: FlatParam) -> torch.Tensor | None:
        """The shard where it lives when that is memory (the optimizer updates it in place), else None."""
        return self._home.get(flat)

    def updated_in_place(self, flat: FlatParam) -> None:
        """The home copy was rewritten in place: drop any cached copy above it."""
        self.store.evict(param_key(flat))

    def write(self, flat: FlatParam, shard: torch.Tensor) -> MoveHandle:
        """New contents for the shard, sent to its home asynchronously; keep `shard` until the handle is done."""
        return self.store.write(param_key(flat), shard)

    def assign(self, flat: FlatParam, shard: torch.Tensor) -> None:
        """Replace the shard's contents now (checkpoint loads, GatheredParameters write-back)."""
        home = self._home.get(flat)
        if home is None:
            self.write(flat, shard.to("cpu", dtype=self._dtype(flat)).contiguous()).wait()
        else:
            with torch.no_grad():
                home.copy_(shard)
            self.updated_in_place(flat)

    @staticmethod
    def _dtype(flat: FlatParam) -> torch.dtype:
        return flat.full.dtype

    def read(self, flat: FlatParam) -> torch.Tensor:
        """A host copy of the shard, wherever it lives (for checkpoints and full state dicts)."""
        home = self._home.get(flat)
        if home is not None:
            return home.cpu().clone() if home.device.type != "cpu" else home.clone()
        key = param_key(flat)
        try:
            return self.store.fetch(key, "host").wait().clone()
        finally:
            self.store.release(key, "host")

    def fetch(self, flat: FlatParam) -> FetchHandle:
        """Start bringing the shard where the compute reads it; `release(flat)` once it is gathered."""
        handle = self.store.fetch(param_key(flat), self.fetch_tier)
        if self.home_tier != self.fetch_tier:
            pair = f"{self.home_tier}->{self.fetch_tier}"
            nbytes = flat.shard_numel * flat.full.element_size()
            self.bytes_moved[pair] = self.bytes_moved.get(pair, 0) + nbytes
        return handle

    def acquire(self, flat: FlatParam) -> torch.Tensor:
        return self.fetch(flat).wait()

    def release(self, flat: FlatParam) -> None:
        key = param_key(flat)
        self.store.release(key, self.fetch_tier)
        if self.home_tier != "device":
            self.store.evict(key)

    def prefetch_to_host(self, flats: Iterable[FlatParam]) -> None:
        """Start reading NVMe-resident shards into host memory, in order, as far as the read-ahead cap
        and the host budget allow."""
        if self.home_tier != "nvme":
            return
        keys, total = [], 0
        for flat in flats:
            total += flat.shard_numel * flat.full.element_size()
            if self.read_ahead_bytes is not None and total > self.read_ahead_bytes:
                break
            keys.append(param_key(flat))
        self.store.prefetch(keys, "host")
