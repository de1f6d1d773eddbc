"""Events of bytes moving between tiers, and the pluggable recorders that keep them.

The store holds `recorder=None` when recording is off and then builds no event and reads no clock.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class MoveEvent:
    """One move of a shard's bytes: `src` and `dst` are tier names ("device", "host", "nvme")."""

    key: Hashable
    nbytes: int
    src: str
    dst: str
    start_ns: int  # time.perf_counter_ns() when the move was issued
    end_ns: int  # ... and when it was complete
    rank: int


class Recorder(Protocol):
    def record(self, event: MoveEvent) -> None: ...


class ListRecorder:
    """Keeps every event in memory, in completion order. Thread-safe."""

    def __init__(self) -> None:
        self.events: list[MoveEvent] = []
        self._lock = threading.Lock()

    def record(self, event: MoveEvent) -> None:
        with self._lock:
            self.events.append(event)

    def clear(self) -> list[MoveEvent]:
        with self._lock:
            events, self.events = self.events, []
        return events


class MoveCounter:
    """Counts the bytes of every move per "src->dst" tier pair (the moves that happened, cache hits none),
    and passes each event on to `forward` (the profiler's writer, or anything with `record`). Thread-safe."""

    def __init__(self, forward: Recorder | None = None) -> None:
        self.bytes: dict[str, int] = {}
        self._forward = forward
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()

    def record(self, event: MoveEvent) -> None:
        pair = f"{event.src}->{event.dst}"
        with self._lock:
            self.bytes[pair] = self.bytes.get(pair, 0) + event.nbytes
        if self._forward is not None:
            self._forward.record(event)

    def live(self, tier: str, nbytes: int, t_ns: int) -> None:
        """A tier's live bytes after a change (forwarded where the receiver records levels)."""
        if hasattr(self._forward, "live"):
            self._forward.live(tier, nbytes, t_ns)

    def held(self, tier: str, holder: str, nbytes: int, t_ns: int) -> None:
        """Of a tier's live bytes, those held for `holder` after a change (forwarded likewise)."""
        if hasattr(self._forward, "held"):
            self._forward.held(tier, holder, nbytes, t_ns)
