"""The tier store on real files: round trips, reference counts, budgets, eviction and prefetch order."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from infinity.config import AioConfig, ConfigError, OffloadOptimizerConfig, OffloadParamConfig
from infinity.storage import (
    ALIGN,
    BudgetError,
    ChecksumError,
    ListRecorder,
    Tier,
    TierBudgets,
    TierStore,
    aligned_empty,
    aligned_view,
)

pytest_plugins = ["storage_fixtures"]  # real directories: a direct-I/O disk, mounts that refuse it
MiB = 1 << 20
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]


def _shard(numel: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), dtype=dtype)
    return torch.randn(numel).to(dtype)


def _store(path: Path | None, recorder=None, **budgets) -> TierStore:
    return TierStore(
        None if path is None else str(path),
        AioConfig(),
        TierBudgets(**budgets),
        recorder=recorder,
        wait_timeout_s=10,
        nvme_grow_bytes=8 * MiB,
    )


@pytest.mark.parametrize("home", ["nvme", "host", "device"])
def test_round_trip_of_every_dtype_and_odd_size_through_every_tier(disk_dir: Path, home: str) -> None:
    with _store(disk_dir) as store:
        shards = {}
        for i in range(24):
            dtype = DTYPES[i % len(DTYPES)]
            numel = random.choice([1, 3, 1000, 4097, 65_537, random.randrange(1, 400_000)])
            shards[i] = _shard(numel, dtype)
            store.put(i, shards[i], home)
        for key in random.sample(list(shards), len(shards)):
            for tier in ("device", "host"):
                got = store.fetch(key, tier).wait()
                assert got.dtype == shards[key].dtype and torch.equal(got, shards[key])
                store.release(key, tier)
        assert home in store.tiers_holding(0)


def test_fetch_of_a_resident_key_is_shared_and_reference_counted(disk_dir: Path) -> None:
    recorder = ListRecorder()
    with _store(disk_dir, recorder) as store:
        store.put("w", _shard(10_000, torch.float32), "nvme").wait()
        a = store.fetch("w", "device").wait()
        moves = len(recorder.events)
        second = store.fetch("w", "device")
        assert second.done()  # resident: at once, no I/O
        b = second.wait()
        assert b.data_ptr() == a.data_ptr() and len(recorder.events) == moves
        store.release("w", "device")
        store.release("w", "device")
        with pytest.raises(RuntimeError, match="without a fetch"):
            store.release("w", "device")


def test_concurrent_fetches_never_exceed_any_budget(disk_dir: Path) -> None:
    budgets = {"device_bytes": 3 * MiB, "host_bytes": 4 * MiB, "nvme_bytes": 64 * MiB}
    with _store(disk_dir, **budgets) as store:
        shards = {i: _shard(random.randrange(50_000, 250_000), torch.float32) for i in range(40)}
        for key, t in shards.items():
            store.put(key, t, "nvme").wait()
        errors = []

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(40):
                    key, tier = rng.choice(list(shards)), rng.choice(["device", "host"])
                    got = store.fetch(key, tier).wait()
                    assert torch.equal(got, shards[key])
                    store.release(key, tier)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        stats = store.stats()
        for tier, limit in (("device", 3 * MiB), ("host", 4 * MiB), ("nvme", 64 * MiB)):
            assert 0 < stats[tier]["high_water_bytes"] <= limit, (tier, stats)


def test_eviction_frees_the_least_recently_released_copy_first(disk_dir: Path) -> None:
    recorder = ListRecorder()
    nbytes = 256 * 1024  # a host budget of 2 shards
    with _store(disk_dir, recorder, host_bytes=2 * nbytes) as store:
        for key in "abc":
            store.put(key, _shard(nbytes // 4, torch.float32), "nvme").wait()
        for key in "ab":
            store.fetch(key, "host").wait()
            store.release(key, "host")
        store.fetch("a", "host").wait()  # a is used again: b is now the least recent
        store.release("a", "host")
        store.fetch("c", "host").wait()
        store.release("c", "host")
        assert "host" in store.tiers_holding("a") and "host" not in store.tiers_holding("b")
        recorder.clear()
        store.fetch("a", "host").wait()  # still cached: no move
        assert recorder.events == []
        assert store.high_water_bytes("host") <= 2 * nbytes


def test_prefetch_loads_in_order_and_stops_at_the_budget(disk_dir: Path) -> None:
    recorder = ListRecorder()
    nbytes = 512 * 1024
    with _store(disk_dir, recorder, device_bytes=2 * nbytes, host_bytes=3 * nbytes) as store:
        keys = [f"block{i}" for i in range(5)]
        for key in keys:
            store.put(key, _shard(nbytes // 4, torch.float32), "nvme").wait()
        recorder.clear()
        started = store.prefetch(keys, "device")
        assert started == keys[:2]  # room for two on the device; never waits, never overshoots
        for key in started:
            store.fetch(key, "device").wait()
        to_device = [e.key for e in recorder.events if e.dst == "device"]
        assert to_device == keys[:2]
        assert store.high_water_bytes("device") <= 2 * nbytes
        # A later prefetch does not evict copies still in use, and keeps the ones it already has.
        assert store.prefetch(keys[1:], "device") == [keys[1]]
        store.release(keys[0], "device")
        assert store.prefetch(keys[1:], "device") == keys[1:3]
        assert "device" not in store.tiers_holding(keys[0])  # released, then evicted for the prefetch
        recorder.clear()
        store.fetch(keys[2], "device").wait()
        assert [e.key for e in recorder.events if e.dst == "device"] in ([], [keys[2]])  # loaded by the prefetch
        assert store.high_water_bytes("device") <= 2 * nbytes


def test_a_copy_released_to_keep_outlives_a_prefetch_and_yields_only_to_a_demand(disk_dir: Path) -> None:
    """A backward gather's host copy kept for the step: read-ahead of later keys must not evict it."""
    nbytes = 256 * 1024
    with _store(disk_dir, host_bytes=3 * nbytes) as store:
        keys = [f"block{i}" for i in range(5)]
        for key in keys:
            store.put(key, _shard(nbytes // 4, torch.float32), "nvme").wait()
        store.fetch("block0", "host").wait()
        store.release("block0", "host", keep=True)  # released first: the least recently used
        store.fetch("block1", "host").wait()
        store.release("block1", "host")
        assert store.prefetch(["block2", "block3"], "host") == ["block2", "block3"]
        assert "host" in store.tiers_holding("block0")  # block1, a plain cached copy, made the room
        assert "host" not in store.tiers_holding("block1")
        assert store.prefetch(["block4"], "host") == []  # a prefetch never evicts another
        store.fetch("block4", "host").wait()  # a demand does: the oldest of them, the kept copy
        assert "host" not in store.tiers_holding("block0")
        assert store.high_water_bytes("host") <= 3 * nbytes


def test_prefetched_copies_are_hits_for_the_fetch_that_follows(disk_dir: Path) -> None:
    recorder = ListRecorder()
    with _store(disk_dir, recorder) as store:
        t = _shard(300_000, torch.bfloat16)
        store.put("x", t, "nvme").wait()
        store.prefetch(["x"], "device")
        store.fetch("x", "device").wait()
        moves = [(e.src, e.dst) for e in recorder.events if e.key == "x"]
        assert moves == [("host", "nvme"), ("nvme", "host"), ("host", "device")]


def test_write_of_a_fetched_host_copy_goes_home_and_drops_stale_copies(disk_dir: Path) -> None:
    with _store(disk_dir) as store:
        store.put("m", _shard(100_000, torch.float32), "nvme").wait()
        store.fetch("m", "device").wait()
        store.release("m", "device")
        master = store.fetch("m", "host").wait()
        master.mul_(2).add_(1)  # an optimizer step in place
        expected = master.clone()
        store.write("m", master).wait()
        assert "device" not in store.tiers_holding("m")  # the old device copy is stale: dropped
        store.release("m", "host")
        store.evict("m")
        assert store.tiers_holding("m") == ["nvme"]
        assert torch.equal(store.fetch("m", "device").wait(), expected)


def test_write_refuses_while_another_copy_is_in_use(disk_dir: Path) -> None:
    with _store(disk_dir) as store:
        store.put("p", _shard(1000, torch.float16), "host").wait()
        store.fetch("p", "device").wait()
        with pytest.raises(RuntimeError, match="still fetched"):
            store.write("p", _shard(1000, torch.float16))
        store.release("p", "device")
        new = _shard(1000, torch.float16)
        store.write("p", new).wait()
        assert torch.equal(store.fetch("p", "device").wait(), new)


def test_evict_moves_the_home_down_and_drop_frees_every_tier(disk_dir: Path) -> None:
    with _store(disk_dir, device_bytes=MiB, host_bytes=MiB) as store:
        t = _shard(50_000, torch.float32)
        store.put("g", t, "device").wait()
        assert store.live_bytes("device") == t.numel() * 4
        store.evict("g", "host")
        assert store.tiers_holding("g") == ["host"] and store.live_bytes("device") == 0
        store.evict("g", "nvme")
        assert store.tiers_holding("g") == ["nvme"] and store.live_bytes("host") == 0
        assert torch.equal(store.fetch("g", "host").wait(), t)
        with pytest.raises(RuntimeError, match="still in use"):
            store.drop("g")
        store.release("g", "host")
        store.drop("g")
        assert "g" not in store
        assert [store.live_bytes(tier) for tier in Tier] == [0, 0, 0]


@pytest.mark.parametrize("held", [False, True])
def test_evicting_a_copy_that_a_write_reads_does_not_wait_for_the_write(disk_dir: Path, held: bool) -> None:
    """A forward gather evicts the parameter shard's host copy that the deferred step's write to NVMe still
    reads (that write may queue behind reads of later blocks): evict returns at once, and the copy is freed
    when the write is done, unless someone still holds it then (as an eviction after the write would)."""
    with _store(disk_dir) as store:
        store.put("p", _shard(300_000, torch.float32), "nvme").wait()
        host = store.fetch("p", "host").wait()
        new = _shard(300_000, torch.float32)
        host.copy_(new)
        gate = threading.Event()
        store._completer.submit(gate.wait)  # moves finish in order: the write's completion waits behind this
        written = store.write("p", host)  # in place: the host copy is the write's source
        if not held:
            store.release("p", "host")
        evicting = threading.Thread(target=store.evict, args=("p",))
        evicting.start()
        evicting.join(5)
        try:
            assert not evicting.is_alive()  # it did not wait for the write
            assert "host" in store.tiers_holding("p") and not written.done()  # the write still reads the copy
        finally:
            gate.set()
        written.wait()
        assert ("host" in store.tiers_holding("p")) is held
        if held:
            store.release("p", "host")
        assert torch.equal(store.fetch("p", "host").wait(), new)
        store.release("p", "host")


def test_a_fetch_waits_for_memory_that_another_thread_releases(disk_dir: Path) -> None:
    with _store(disk_dir, device_bytes=MiB) as store:
        for key in "ab":
            store.put(key, _shard(MiB // 4, torch.float32), "host").wait()
        store.fetch("a", "device").wait()
        got = []
        waiter = threading.Thread(target=lambda: got.append(store.fetch("b", "device").wait()))
        waiter.start()
        waiter.join(0.3)
        assert not got  # blocked: the budget holds one shard and "a" is in use
        store.release("a", "device")
        waiter.join(5)
        assert got and store.high_water_bytes("device") <= MiB


class MemoryWaits(ListRecorder):
    """A recorder that keeps the store's waits for memory: (tier, holder, key, waited ns)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[tuple] = []

    def live(self, tier: str, nbytes: int, t_ns: int) -> None: ...

    def held(self, tier: str, holder: str, nbytes: int, t_ns: int) -> None: ...

    def memory_wait(self, tier: str, holder: str, key, start_ns: int, end_ns: int) -> None:
        self.waits.append((tier, holder, key, end_ns - start_ns))


def test_a_wait_for_memory_goes_to_the_recorder_and_a_reclaim_does_not(disk_dir: Path) -> None:
    """An allocation that waits for a release (the budget spent, nothing cached to reclaim) tells the recorder
    which tier, holder and key waited, and for how long; one that frees a cached copy instead tells nothing."""
    recorder = MemoryWaits()
    a, b = ("a", "param"), ("b", "param")
    with _store(disk_dir, recorder, device_bytes=MiB) as store:
        for key in (a, b):
            store.put(key, _shard(MiB // 4, torch.float32), "host").wait()
        store.fetch(a, "device").wait()
        store.release(a, "device")  # cached: the next fetch reclaims it
        store.fetch(b, "device").wait()
        assert recorder.waits == []
        waiter = threading.Thread(target=lambda: store.fetch(a, "device").wait())
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # "b" is in use and fills the budget
        store.release(b, "device")
        waiter.join(5)
        assert [w[:3] for w in recorder.waits] == [("device", "param", a)] and recorder.waits[0][3] > 0


def test_a_shard_larger_than_a_budget_fails_at_once_and_the_store_goes_on(disk_dir: Path) -> None:
    with _store(disk_dir, device_bytes=MiB) as store:
        store.put("big", _shard(MiB, torch.float32), "host").wait()
        store.put("small", _shard(1000, torch.float32), "host").wait()
        with pytest.raises(BudgetError, match="can never fit"):
            store.fetch("big", "device")
        store.fetch("small", "device").wait()


def test_every_move_is_recorded_with_key_bytes_tiers_times_and_rank(disk_dir: Path) -> None:
    recorder = ListRecorder()
    with TierStore(str(disk_dir), AioConfig(), TierBudgets(), rank=3, recorder=recorder) as store:
        store.put("k", _shard(12_345, torch.float16), "nvme").wait()
        store.fetch("k", "device").wait()
    events = recorder.events
    assert [(e.src, e.dst) for e in events] == [("host", "nvme"), ("nvme", "host"), ("host", "device")]
    assert all(e.key == "k" and e.nbytes == 12_345 * 2 and e.rank == 3 and 0 < e.start_ns <= e.end_ns for e in events)


def test_nvme_slots_sit_at_aligned_offsets_of_one_preallocated_file(disk_dir: Path) -> None:
    with _store(disk_dir) as store:
        for i in range(10):
            store.put(i, _shard(random.randrange(1, 100_000), torch.uint8), "nvme").wait()
        files = list(disk_dir.iterdir())
        assert files == [Path(store.swap_path)]
        assert all(store._shards[i].nvme_offset % ALIGN == 0 for i in range(10))
        assert Path(store.swap_path).stat().st_size >= 8 * MiB  # grown in chunks, not per shard


def test_aiofiles_backend_serves_a_store_where_direct_io_is_refused(no_direct_io_dir: Path) -> None:
    with _store(no_direct_io_dir) as store:
        assert store.backend == "aiofiles"
        t = _shard(77_777, torch.bfloat16)
        store.put("a", t, "nvme").wait()
        assert torch.equal(store.fetch("a", "device").wait(), t)


def test_from_config_takes_the_nvme_path_and_refuses_two_paths(disk_dir: Path) -> None:
    param = OffloadParamConfig(device="nvme", nvme_path=str(disk_dir))
    with TierStore.from_config(param, OffloadOptimizerConfig(), AioConfig(), TierBudgets()) as store:
        assert store.swap_path.startswith(str(disk_dir))
    with pytest.raises(ConfigError, match="nvme_path"):
        TierStore.from_config(OffloadParamConfig(device="nvme"), OffloadOptimizerConfig(), AioConfig(), TierBudgets())
    other = OffloadOptimizerConfig(device="nvme", nvme_path=str(disk_dir / "elsewhere"))
    with pytest.raises(ConfigError, match="different nvme_path"):
        TierStore.from_config(param, other, AioConfig(), TierBudgets())


def test_a_store_without_nvme_keeps_device_and_host_tiers() -> None:
    with _store(None, device_bytes=MiB, host_bytes=MiB) as store:
        t = _shard(1000, torch.float32)
        store.put("a", t, "host").wait()
        assert torch.equal(store.fetch("a", "device").wait(), t)
        with pytest.raises(ValueError, match="no nvme_path"):
            store.put("b", t, "nvme")


def test_aligned_host_tensors_are_written_in_place_and_others_through_staging(disk_dir: Path) -> None:
    with _store(disk_dir, host_bytes=MiB) as store:
        aligned = aligned_empty(5000 * 4).view(torch.float32)  # 20_000 bytes: padded on disk, in place
        aligned.copy_(torch.randn(5000))
        unaligned = torch.randn(5001)[1:]
        assert aligned_view(aligned) is not None and aligned_view(unaligned) is None
        store.put("a", aligned, "nvme").wait()
        store.put("u", unaligned, "nvme").wait()
        assert store.high_water_bytes("host") == 20_480  # the staging copy of "u" only
        assert torch.equal(store.fetch("a", "host").wait(), aligned)
        assert torch.equal(store.fetch("u", "host").wait(), unaligned)


def test_a_done_write_holds_nothing_of_its_source_while_the_mover_finishes(disk_dir: Path, monkeypatch) -> None:
    """Once a write's handle is done the caller may reuse its tensor, and a pool that lends memory by use count
    (CollectiveBuffers) must find nothing else holding it, even while the mover's thread is still in the job."""
    from infinity.storage.tier_types import MoveHandle

    signalled, resume = threading.Event(), threading.Event()
    finish = MoveHandle.finish

    def finish_and_linger(self, error=None):
        finish(self, error)
        signalled.set()
        resume.wait(10)  # the mover's thread stays in the write's job until the check below is done

    monkeypatch.setattr(MoveHandle, "finish", finish_and_linger)
    use_count = torch._C._storage_Use_Count
    with _store(disk_dir, host_bytes=MiB) as store:
        for home, tensor in (("nvme", aligned_empty(5000 * 4).view(torch.float32)), ("host", torch.randn(5000))):
            tensor.fill_(1.0)
            storage = tensor.untyped_storage()
            alone = use_count(storage._cdata)
            signalled.clear()
            resume.clear()
            handle = store.put(home, tensor, home)
            try:
                handle.wait()
                assert signalled.wait(10)
                assert use_count(storage._cdata) == alone, home
            finally:
                resume.set()  # and left set: nothing else the store finishes lingers
            assert torch.equal(store.fetch(home, "host").wait(), tensor)
            store.release(home, "host")


def test_a_fetch_of_a_key_dropped_and_put_again_meanwhile_waits_for_the_new_put(disk_dir: Path, monkeypatch) -> None:
    """A key dropped and put again between a fetch's start and its load: the fetch is of the new key and waits for
    the put's write into the new home copy (before, it took the dropped key's state and handed over the new home
    buffer while that write was still queued: recycled bytes, the mixed-moves test's rare failure)."""
    with _store(disk_dir, host_bytes=MiB) as store:
        store.put("k", torch.full((5000,), 1.0), "host").wait()
        gate = threading.Event()
        store._completer.submit(lambda: gate.wait(10))  # the mover is busy: the put below stays queued
        load = store._load

        def drop_and_put_first(*args, **kwargs):
            monkeypatch.setattr(store, "_load", load)
            store.drop("k")
            store.put("k", torch.full((5000,), 2.0), "host")
            return load(*args, **kwargs)

        monkeypatch.setattr(store, "_load", drop_and_put_first)
        try:
            handle = store.fetch("k", "host")
            assert not handle.done()  # the new home's contents are still on their way
        finally:
            gate.set()
        assert torch.equal(handle.wait(), torch.full((5000,), 2.0))
        store.release("k", "host")


def _refs(store: TierStore, key) -> dict[str, int]:
    return {c.tier.value: c.refs for c in store._shards[key].copies.values()}


def test_a_device_fetch_retried_after_its_host_source_went_waits_for_memory_outside_the_lock(
    disk_dir: Path, monkeypatch
) -> None:
    """The host copy a device copy was to come from is freed while the device buffer is allocated: the retry
    stages a new host copy and waits for host memory. It waited holding the store's lock, so the release that
    would end the wait (and the mover) blocked until it timed out."""
    with _store(disk_dir, host_bytes=MiB, device_bytes=8 * MiB) as store:
        store.put("k", torch.full((100_000,), 1.0), "nvme").wait()  # 400 kB
        store.put("filler", torch.full((175_000,), 2.0), "nvme").wait()  # 700 kB: the two never fit together
        store.fetch("k", "host").wait()
        store.release("k", "host")  # cached: the device fetch copies from it, staging nothing
        alloc = store._alloc

        def source_gone_meanwhile(tier, *args, **kwargs):
            if tier is Tier.DEVICE:
                monkeypatch.setattr(store, "_alloc", alloc)
                store.evict("k")  # the host copy goes (as a reclaim for another fetch frees it)
                store.fetch("filler", "host").wait()  # and its memory is taken

                def release_once_waited_for() -> None:
                    while not store._mem[Tier.HOST].waiting:
                        time.sleep(0.001)
                    store.release("filler", "host")

                threading.Thread(target=release_once_waited_for, daemon=True).start()
            return alloc(tier, *args, **kwargs)

        monkeypatch.setattr(store, "_alloc", source_gone_meanwhile)
        assert torch.equal(store.fetch("k", "device").wait(), torch.full((100_000,), 1.0))  # was a BudgetError
        store.release("k", "device")


def test_a_device_load_that_gets_no_memory_lets_go_of_its_staged_host_copy(disk_dir: Path) -> None:
    with _store(disk_dir, device_bytes=MiB // 2, host_bytes=8 * MiB) as store:
        store.put("k", torch.full((200_000,), 2.0), "nvme").wait()  # 800 kB: fits the host, never the device
        with pytest.raises(BudgetError, match="can never fit"):
            store.prefetch(["k"], "device")
        with pytest.raises(BudgetError, match="can never fit"):
            store.fetch("k", "device")
        store._completer.flush()
        assert _refs(store, "k") == {"host": 0}  # cached, held by nobody (was 1, then 2: never freed)
        store.drop("k")


def test_moving_a_home_down_to_a_full_nvme_budget_lets_go_of_its_host_copy(disk_dir: Path) -> None:
    with _store(disk_dir, host_bytes=8 * MiB, nvme_bytes=MiB) as store:
        store.put("fill", torch.full((MiB // 4,), 1.0), "nvme").wait()  # the NVMe budget is spent
        store.put("k", torch.full((10_000,), 2.0), "device").wait()
        with pytest.raises(BudgetError):
            store.evict("k", "nvme")
        assert store._shards["k"].home is Tier.DEVICE and _refs(store, "k") == {"device": 0, "host": 0}
        store.drop("k")


def test_a_device_fetch_of_a_damaged_nvme_copy_raises_once_instead_of_reading_it_again(
    disk_dir: Path, monkeypatch
) -> None:
    """The staged host load fails (and its copy is freed) while the device buffer is allocated: the fetch raises
    the read's error; it used to see the host copy gone and start again, the same failing read each time."""
    with _store(disk_dir, host_bytes=8 * MiB) as store:
        store.put("k", torch.full((10_000,), 1.0), "nvme").wait()
        path, offset, _ = store.location("k")
        with open(path, "r+b") as f:  # a flipped byte on disk
            f.seek(offset + 100)
            byte = f.read(1)
            f.seek(offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        alloc, device_allocs = store._alloc, []

        def after_the_host_load_failed(tier, *args, **kwargs):
            if tier is Tier.DEVICE:
                device_allocs.append(tier)
                assert len(device_allocs) < 5, "the fetch reads the damaged copy again and again"
                store._completer.flush()  # the staged read has run and failed meanwhile
            return alloc(tier, *args, **kwargs)

        monkeypatch.setattr(store, "_alloc", after_the_host_load_failed)
        with pytest.raises(ChecksumError, match="fetch of 'k'"):
            store.fetch("k", "device").wait()
        assert len(device_allocs) == 1


def test_moves_asked_of_a_closed_store_fail_at_once_instead_of_never_finishing(disk_dir: Path, monkeypatch) -> None:
    store = _store(disk_dir, host_bytes=8 * MiB)
    store.put("k", torch.full((10_000,), 1.0), "host").wait()
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.write("k", torch.full((10_000,), 2.0))  # its job went to the stopped mover: wait() never returned

    store = _store(disk_dir, host_bytes=8 * MiB)
    alloc = store._alloc

    def closed_meanwhile(*args, **kwargs):
        buf = alloc(*args, **kwargs)
        store.close()  # another thread closes the store while put allocates
        return buf

    monkeypatch.setattr(store, "_alloc", closed_meanwhile)
    with pytest.raises(RuntimeError, match="closed"):
        store.put("k", torch.full((10_000,), 1.0), "host")
    assert "k" not in store


def test_mixed_concurrent_moves_keep_every_key_whole_and_every_budget(disk_dir: Path) -> None:
    """Readers, writers, prefetch, evict and drop/put race for 3 s; each read sees one whole version."""
    budgets = {"device_bytes": 2 * MiB, "host_bytes": 6 * MiB, "nvme_bytes": 64 * MiB}
    with _store(disk_dir, **budgets) as store:
        sizes = {k: random.randrange(1000, 150_000) for k in range(16)}
        versions = {k: 0 for k in sizes}
        for k, n in sizes.items():
            store.put(k, torch.full((n,), k * 1000.0), "host" if k % 3 == 0 else "nvme").wait()
        deadline = time.monotonic() + 3
        errors = []

        def whole(k: int, t: torch.Tensor) -> None:
            v = float(t[0])
            assert bool((t == v).all()) and 0 <= v - k * 1000 <= versions[k], (k, v)

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            mine = [k for k in sizes if k % 4 == seed]  # each key has one writer
            while time.monotonic() < deadline and not errors:
                try:
                    r = rng.random()
                    if r < 0.6:
                        k, tier = rng.randrange(len(sizes)), rng.choice(["device", "host"])
                        whole(k, store.fetch(k, tier).wait())
                        store.release(k, tier)
                    elif r < 0.8:
                        k = rng.choice(mine)
                        versions[k] += 1
                        store.write(k, torch.full((sizes[k],), k * 1000.0 + versions[k])).wait()
                    elif r < 0.9:
                        store.prefetch(rng.sample(list(sizes), 4), rng.choice(["device", "host"]))
                    elif r < 0.95:
                        store.evict(rng.randrange(len(sizes)))
                    else:
                        k = rng.choice(mine)
                        store.drop(k)
                        versions[k] += 1
                        store.put(k, torch.full((sizes[k],), k * 1000.0 + versions[k]), rng.choice(["host", "nvme"]))
                except KeyError:
                    pass  # a key dropped by its writer, about to come back
                except RuntimeError as exc:
                    if "still" not in str(exc):  # write/drop refused while another thread holds a copy
                        errors.append(exc)
                except BaseException as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        for k in sizes:
            whole(k, store.fetch(k, "host").wait())
            store.release(k, "host")
        stats = store.stats()
        for tier, limit in budgets.items():
            assert stats[tier.split("_")[0]]["high_water_bytes"] <= limit


def test_a_copy_fetched_to_overwrite_reads_nothing_and_once_written_in_place_is_the_cached_copy(disk_dir: Path):
    recorder = ListRecorder()
    with _store(disk_dir, recorder) as store:
        old, new = _shard(70_000, torch.bfloat16), _shard(70_000, torch.bfloat16)
        store.put("w", old, "nvme").wait()
        recorder.clear()
        blank = store.fetch_to_overwrite("w", "host")
        assert recorder.events == []  # nothing read from the file
        blank.copy_(new)
        store.write("w", blank).wait()
        store.release("w", "host", keep=True)
        assert [(e.src, e.dst) for e in recorder.events] == [("host", "nvme")]
        recorder.clear()
        got = store.fetch("w", "host").wait()  # the written copy, not a read of the file
        assert got.data_ptr() == blank.data_ptr() and torch.equal(got, new) and recorder.events == []
        store.release("w", "host")
        store.evict("w")
        assert torch.equal(store.fetch("w", "host").wait(), new)  # and the file holds the same bytes
        assert [(e.src, e.dst) for e in recorder.events] == [("nvme", "host")]
        store.release("w", "host")


def test_a_copy_fetched_to_overwrite_shares_a_copy_already_there_once_loaded(disk_dir: Path):
    with _store(disk_dir) as store:
        old = _shard(70_000, torch.float32)
        store.put("w", old, "nvme").wait()
        assert store.prefetch(["w"], "host") == ["w"]  # a read in flight
        shared = store.fetch_to_overwrite("w", "host")
        assert torch.equal(shared, old)  # loaded before it was handed over: no read lands on new bytes later
        assert shared.data_ptr() == store.fetch("w", "host").wait().data_ptr()
        store.release("w", "host")
        store.release("w", "host")
