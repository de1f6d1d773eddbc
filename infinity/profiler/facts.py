"""What the diagnosis knows about the traced run besides its events: config, disk, sizes, compute device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infinity.profiler.format import kind_of_key
from infinity.profiler.knob_effects import itemsize
from infinity.profiler.traces import RankTrace


def _config_from_settings(settings: dict) -> dict:
    """A partial config from the meta `settings` of a trace written before meta carried `config`."""
    zero = {k: v for k, v in settings.items() if k != "aio"}
    return {"zero_optimization": zero, "aio": settings.get("aio") or {}}


@dataclass
class RunFacts:
    """The run's config (resolved, as a dict), world size, probed disk and the sizes its moves show."""

    config: dict[str, Any]
    world_size: int
    raw_disk: dict[str, Any] | None
    cuda: bool
    has_config: bool  # False: an older trace without meta `config` (clipping and dtype unknown)
    largest_param_bytes: int = 0  # the largest parameter shard read (bytes of one move)
    notes: list[str] = field(default_factory=list)

    @property
    def gradient_clipping(self) -> float:
        return float(self.config.get("gradient_clipping") or 0.0)

    @property
    def fp16(self) -> bool:
        return (self.config.get("fp16") or {}).get("enabled") is True

    @property
    def optimizer_device(self) -> str:
        return ((self.config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")

    @property
    def optimizer_window(self) -> int:
        zero = self.config.get("zero_optimization") or {}
        return int((zero.get("offload_optimizer") or {}).get("buffer_count") or 4)

    @property
    def block_elems(self) -> int:
        """Elements of the largest gathered block (its shard times the ranks)."""
        return self.largest_param_bytes // itemsize(self.config) * self.world_size

    def raw(self, reads: bool) -> float | None:
        """The probed disk's GB/s for reads (writes); None when unknown or not a direct-I/O measure."""
        raw = self.raw_disk or {}
        if reads and raw.get("backend") == "aiofiles":
            return None  # read back from the page cache: not the disk's speed
        value = raw.get("read_gbps" if reads else "write_gbps")
        return float(value) if value else None

    @classmethod
    def of(cls, traces: list[RankTrace]) -> RunFacts:
        meta = traces[0].meta if traces else {}
        config = meta.get("config")
        facts = cls(
            config=config if isinstance(config, dict) else _config_from_settings(meta.get("settings") or {}),
            world_size=int(meta.get("world_size", len(traces) or 1)),
            raw_disk=meta.get("raw_disk"),
            cuda=meta.get("device") == "cuda",
            has_config=isinstance(config, dict),
        )
        reads = [r["bytes"] for t in traces for r in t.of("move") if kind_of_key(r["key"]) == "param"]
        facts.largest_param_bytes = max(reads, default=0)
        if (facts.raw_disk or {}).get("backend") == "aiofiles":
            facts.notes.append(
                "the swap directory does not take O_DIRECT: the disk probe's reads came from the page cache, "
                "so read efficiency is not stated"
            )
        return facts
