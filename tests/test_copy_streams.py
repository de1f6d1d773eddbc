"""Copies with explicit ordering, exercised on a CPU-only machine with a simulated copy stream.

`simulate_async_copies` makes the copy stream a thread that runs each copy late, as a GPU's copy engine
runs behind the CPU. Every wait point of the real CUDA path is then a real wait here: a consumer that
skipped its wait, or a source buffer reused before its copy ran, reads the wrong bytes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infinity.config import AioConfig
from infinity.storage import Tier, TierBudgets, TierStore
from infinity.storage.streams import CopyStream, simulate_async_copies

pytest_plugins = ["storage_fixtures"]
CPU = torch.device("cpu")
DELAY_S = 0.2  # far longer than anything the test does between issuing a copy and reading its result


@pytest.mark.unit
def test_without_simulation_a_cpu_copy_is_done_when_it_returns():
    src, dst = torch.arange(10.0), torch.zeros(10)
    done = CopyStream(CPU).copy(dst, src)
    assert done.done() and torch.equal(dst, src)


@pytest.mark.unit
def test_a_simulated_copy_lands_late_and_each_wait_waits_for_it():
    with simulate_async_copies(DELAY_S):
        stream = CopyStream(CPU)
    try:
        src = torch.arange(1000.0)
        for wait in ("synchronize", "wait_on_current_stream"):
            dst = torch.zeros(1000)
            done = stream.copy(dst, src)
            assert not done.done() and dst.sum() == 0  # still on its way: a consumer must wait
            getattr(done, wait)()
            assert done.done() and torch.equal(dst, src)
    finally:
        stream.close()


@pytest.mark.unit
def test_a_copy_runs_after_the_copy_it_depends_on():
    with simulate_async_copies(DELAY_S):
        first, second = CopyStream(CPU), CopyStream(CPU)  # two streams: only `after` orders them
    try:
        a, b, c = torch.arange(100.0), torch.zeros(100), torch.zeros(100)
        done_ab = first.copy(b, a)
        done_bc = second.copy(c, b, after=done_ab)
        done_bc.synchronize()
        assert torch.equal(c, a)
    finally:
        first.close()
        second.close()


def _store(path: Path, **budgets) -> TierStore:
    return TierStore(str(path), AioConfig(), TierBudgets(**budgets), device=CPU, wait_timeout_s=30)


def test_a_fetch_to_the_device_gives_the_bytes_even_when_the_copy_lands_late(disk_dir: Path):
    with simulate_async_copies(DELAY_S), _store(disk_dir) as store:
        value = torch.randn(50_000)
        store.put("a", value, Tier.HOST)
        handle = store.fetch("a", Tier.DEVICE)
        assert torch.equal(handle.wait(), value)  # wait() is the compute's wait on the copy's event
        store.release("a", Tier.DEVICE)


def test_a_source_buffer_is_not_reused_while_a_late_copy_still_reads_it(disk_dir: Path):
    """Host memory for one shard: a's host copy (staged from NVMe for its copy to the device) is the only
    buffer b's fetch can take. Released before the late copy ran, b's bytes would land in a's device copy."""
    n = 16_384  # 64 KiB: a whole number of 4 KiB pages, so the two shards need the same buffer
    with simulate_async_copies(DELAY_S), _store(disk_dir, host_bytes=4 * n) as store:
        a, b = torch.randn(n), torch.randn(n)
        store.put("a", a, Tier.NVME).wait()
        store.put("b", b, Tier.NVME).wait()
        on_device = store.fetch("a", Tier.DEVICE)
        on_host = store.fetch("b", Tier.HOST)  # waits for host memory: a's host copy, once a's copy is done
        assert torch.equal(on_host.wait(), b)
        assert torch.equal(on_device.wait(), a)
        store.release("a", Tier.DEVICE)
        store.release("b", Tier.HOST)


def test_a_write_or_drop_right_after_a_fetch_waits_for_its_late_copy(disk_dir: Path):
    """A released device copy whose copy still reads the home keeps a reference on it until the copy is
    done: a write or a drop issued meanwhile waits for that (rather than refusing a "fetched" copy)."""
    with simulate_async_copies(DELAY_S), _store(disk_dir) as store:
        old, new = torch.randn(30_000), torch.randn(30_000)
        for key in ("written", "dropped"):
            store.put(key, old, Tier.HOST)
            store.fetch(key, Tier.DEVICE)
            store.release(key, Tier.DEVICE)  # cached; its copy from the home still on its way
        store.write("written", new).wait()
        assert torch.equal(store.fetch("written", Tier.DEVICE).wait(), new)  # not the stale cached copy
        store.release("written", Tier.DEVICE)
        store.drop("dropped")
        assert "dropped" not in store
