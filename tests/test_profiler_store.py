"""TraceWriter as the tier store's recorder: the bytes in the trace are the bytes the store moved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infinity.profiler import TraceWriter
from infinity.profiler.analysis import bytes_by_pair, validate
from infinity.profiler.traces import load_traces

pytestmark = pytest.mark.unit

storage = pytest.importorskip("infinity.storage")
config = pytest.importorskip("infinity.config")


class Tee:
    """Hands each event to several recorders."""

    def __init__(self, *recorders) -> None:
        self.recorders = recorders

    def record(self, event) -> None:
        for r in self.recorders:
            r.record(event)


def test_trace_bytes_equal_the_store_moves_through_every_tier(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / "trace", 0, 1, {}, flush_every=3)
    kept = storage.ListRecorder()
    swap = tmp_path / "swap"
    swap.mkdir()
    shards = {f"b{i}": torch.randn(10_000 + 4096 * i) for i in range(4)}
    writer.begin_step(0)
    with storage.TierStore(str(swap), config.AioConfig(), storage.TierBudgets(), recorder=Tee(writer, kept),
                           wait_timeout_s=10, nvme_grow_bytes=8 << 20) as store:
        for key, shard in shards.items():
            store.put(key, shard, "nvme").wait()
        writer.set_phase("backward")
        for key, shard in shards.items():
            for tier in ("host", "device"):
                assert torch.equal(store.fetch(key, tier).wait(), shard)
                store.release(key, tier)
    writer.end_step(0)
    writer.close()
    expected: dict[str, int] = {}
    for e in kept.events:
        pair = f"{e.src}->{e.dst}"
        expected[pair] = expected.get(pair, 0) + e.nbytes
    traces = load_traces([tmp_path / "trace"])
    assert validate(traces) == []
    assert bytes_by_pair(traces) == expected
    total = sum(s.numel() * 4 for s in shards.values())
    assert expected["host->nvme"] >= total and expected["nvme->host"] >= total  # each shard written and read
    assert {r["block"] for r in traces[0].of("move")} == set(shards)
