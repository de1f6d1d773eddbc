"""The caching CPU allocator (native/torch/host_allocator.cpp, `host_memory.keep_freed_blocks`): torch's
CPU allocations of 1 MiB or more reuse freed blocks, up to a cap, instead of fresh mappings; smaller ones
stay with malloc. Each test gives up its hold, so torch has its own allocator back after it."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
import torch
from harness import assert_matches_plain_pytorch, assert_weights_close, config, reference_train, train_on_rank

import infinity
from infinity import _host_allocator as native
from infinity.engine import host_memory
from infinity.engine.host_memory import freed_block_stats, keep_freed_blocks
from infinity.models.mlp import MLP

pytest_plugins = ["storage_fixtures"]  # disk_dir: a directory on a disk that takes O_DIRECT

MIB = 1 << 20


@pytest.fixture
def hold(monkeypatch) -> Iterator:
    """keep_freed_blocks with this test's caps; every hold given up at the end (and the allocator with it)."""
    monkeypatch.delenv("INFINITY_KEEP_MALLOC", raising=False)
    holds = []

    def take(cap_bytes: int):
        holds.append(keep_freed_blocks(cap_bytes))
        return holds[-1]

    yield take
    for give_up in holds:
        give_up()
    assert not native.installed()


def _floats(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes // 4, dtype=torch.float32)


def test_a_freed_block_is_lent_again_and_live_blocks_are_never_shared(hold) -> None:
    hold(64 * MIB)
    assert native.installed()
    before = freed_block_stats()
    kept = torch.arange(MIB, dtype=torch.float32)  # 4 MiB, live throughout
    a = _floats(4 * MIB)
    address = a.data_ptr()
    del a
    b = _floats(4 * MIB)
    assert b.data_ptr() == address  # the freed block, not a fresh mapping
    b.fill_(-1.0)
    c = _floats(4 * MIB)  # b is live: c must be other memory
    c.fill_(7.0)
    after = freed_block_stats()
    assert after["hits"] - before["hits"] == 1 and after["misses"] - before["misses"] == 3
    assert c.data_ptr() not in (b.data_ptr(), kept.data_ptr())
    assert torch.equal(kept, torch.arange(MIB, dtype=torch.float32))  # nothing wrote over a live block
    assert bool((b == -1.0).all())


def test_a_block_up_to_an_eighth_larger_serves_and_a_larger_one_does_not(hold) -> None:
    hold(64 * MIB)
    big = _floats(8 * MIB)
    address = big.data_ptr()
    del big
    far = _floats(6 * MIB)  # 8 MiB is a third larger than asked: a fresh block
    assert far.data_ptr() != address
    near = _floats(8 * MIB - 512 * 1024)  # 8 MiB is within an eighth
    assert near.data_ptr() == address


def test_the_cache_keeps_at_most_its_cap_and_gives_the_oldest_back_first(hold) -> None:
    hold(8 * MIB)
    before = freed_block_stats()
    blocks = [_floats(3 * MIB) for _ in range(4)]
    addresses = [t.data_ptr() for t in blocks]
    while blocks:
        blocks.pop(0)  # freed in order: the first two no longer fit under the cap
    stats = freed_block_stats()
    assert stats["cached_bytes"] <= 8 * MIB
    assert stats["returned"] - before["returned"] == 2
    again = [_floats(3 * MIB) for _ in range(2)]
    assert {t.data_ptr() for t in again} == set(addresses[2:])  # the newest two were kept


def test_small_blocks_stay_with_malloc(hold) -> None:
    hold(64 * MIB)
    before = freed_block_stats()
    small = [torch.ones(1000) for _ in range(50)] + [_floats(MIB - 4096)]
    assert sum(float(t.sum()) for t in small[:50]) == 50_000
    after = freed_block_stats()
    assert (after["hits"], after["misses"], after["live_bytes"]) == (
        before["hits"],
        before["misses"],
        before["live_bytes"],
    )


def test_huge_page_blocks_start_on_a_2_mib_boundary(hold) -> None:
    hold(64 * MIB)
    native.install(64 * MIB, MIB, True)  # as keep_freed_blocks does where malloc asks for huge pages
    blocks = [_floats(n * MIB + 4096) for n in (2, 3, 5)]
    assert all(t.data_ptr() % (2 * MIB) == 0 for t in blocks)
    for t in blocks:
        t.fill_(1.0)  # the whole mapping is writable
    assert all(bool((t == 1.0).all()) for t in blocks)


def test_the_largest_cap_applies_and_the_last_hold_gives_torch_its_allocator_back(hold) -> None:
    small_hold = hold(4 * MIB)
    big_hold = hold(32 * MIB)
    early = _floats(2 * MIB)  # allocated through the cache, freed after it is gone
    blocks = [_floats(5 * MIB) for _ in range(4)]
    del blocks
    assert freed_block_stats()["cached_bytes"] == 20 * MIB  # under the larger cap
    big_hold()
    assert native.installed() and freed_block_stats()["cached_bytes"] <= 4 * MIB
    small_hold()
    assert not native.installed() and freed_block_stats()["cached_bytes"] == 0
    live = freed_block_stats()["live_bytes"]
    early.fill_(3.0)
    del early  # its deleter is still the cache's: the block goes back to the OS, not into a list
    stats = freed_block_stats()
    assert stats["live_bytes"] == live - 2 * MIB and stats["cached_bytes"] == 0
    fresh = _floats(2 * MIB)
    assert freed_block_stats()["misses"] == stats["misses"]  # torch's own allocator again
    del fresh


def test_no_hold_where_the_user_keeps_malloc_or_the_cap_is_zero(monkeypatch) -> None:
    keep_freed_blocks(0)()
    assert not native.installed()
    monkeypatch.setenv("INFINITY_KEEP_MALLOC", "1")
    give_up = keep_freed_blocks(64 * MIB)
    assert not native.installed()
    give_up()


def test_without_the_native_build_nothing_is_held_and_the_user_is_told_how_to_build_it(monkeypatch, capsys) -> None:
    monkeypatch.delenv("INFINITY_KEEP_MALLOC", raising=False)
    monkeypatch.setitem(sys.modules, "infinity._host_allocator", None)  # the import fails, as unbuilt
    monkeypatch.delattr(infinity, "_host_allocator")
    monkeypatch.setattr(host_memory, "_missing_told", False)
    give_up = keep_freed_blocks(64 * MIB)
    give_up()
    assert "--no-build-isolation" in capsys.readouterr().err
    assert not native.installed()


def test_threads_allocating_and_freeing_at_once_leave_the_counts_exact(hold) -> None:
    hold(16 * MIB)
    live = freed_block_stats()["live_bytes"]
    errors: list[str] = []

    def churn(seed: int) -> None:
        for i in range(200):
            t = torch.full(((1 + (seed + i) % 3) * MIB // 4,), float(seed))
            if not bool((t == seed).all()):
                errors.append(f"thread {seed} saw another's values")
            del t

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = freed_block_stats()
    assert not errors
    assert stats["live_bytes"] == live and stats["cached_bytes"] <= 16 * MIB
    assert stats["hits"] > 0


def test_a_child_forked_while_another_thread_allocates_can_allocate(hold) -> None:
    """The lock is held across fork by the forking thread only (pthread_atfork), so no child starts with it
    held by a thread it does not have."""
    import os
    import time

    hold(16 * MIB)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            torch.empty(2 * MIB // 4)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(20):
            pid = os.fork()
            if pid == 0:  # the child: a large block through the cache, then out without cleanup
                os._exit(0 if torch.empty(3 * MIB // 4).data_ptr() else 1)
            deadline = time.monotonic() + 30
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            if done[0] == 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "a forked child hung or failed"
    finally:
        stop.set()
        thread.join()


WIDE = dict(in_features=16, hidden=640, out_features=8, n_layers=3)  # 1.6 MB weights: above the 1 MiB floor


def _wide_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP(**WIDE)


def test_a_budgeted_engine_reuses_freed_gradients_and_trains_as_plain_pytorch(disk_dir, monkeypatch) -> None:
    """One rank, parameters and optimizer on NVMe under a host budget, clipped: malloc returns freed memory
    to the OS, so the engine keeps one block's gradients of it (the plan's figure) for reuse. Autograd's
    1.6 MB weight gradients come from freed blocks after the first step; losses and weights are plain
    PyTorch's; the engine's close gives the allocator up."""
    monkeypatch.delenv("INFINITY_KEEP_MALLOC", raising=False)
    cfg = config("mlp", offload_param="nvme", offload_optimizer="nvme", nvme_path=str(disk_dir), clip=1.0,
                 extra_zero={"host_budget_bytes": 512 * MIB})  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 16, generator=gen), torch.randn(2, 8, generator=gen)) for _ in range(4)]
    ref = reference_train(_wide_mlp, iter(data), steps=4)
    engine, _, _, _ = infinity.initialize(model=_wide_mlp(), config=cfg)
    try:
        assert native.installed()
        losses, counts = [], []
        for x, y in data:
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            counts.append(freed_block_stats())
        assert losses == pytest.approx(ref.losses, rel=1e-5)
        # steps 3 and 4: both wide layers' weight gradients from freed blocks, and no fresh mapping at all
        assert counts[3]["hits"] - counts[1]["hits"] >= 2 * 2
        assert counts[3]["misses"] == counts[1]["misses"]
        state = engine.full_state_dict()
    finally:
        engine.close()
    assert not native.installed()
    assert_weights_close(state, ref.state)


@pytest.mark.parametrize(
    "offload_param, dtype, clip, grad_accum",
    [
        ("nvme", "fp32", 1.0, 1),
        ("nvme", "bf16", 1.0, 2),
        ("none", "fp32", 0.0, 1),
        ("cpu", "fp32", 1.0, 1),
        ("nvme", "fp32", 0.0, 2),
    ],
)
def test_no_step_reads_a_reused_block_before_writing_it(offload_param, dtype, clip, grad_accum, disk_dir, monkeypatch):
    """Reused memory is not zeroed, as fresh mappings were. With every block of 4 KiB or more lent through
    the cache and filled with NaN first, budgeted one-rank runs still train as plain PyTorch: no gather,
    gradient, flat or step reads memory it did not write."""
    monkeypatch.delenv("INFINITY_KEEP_MALLOC", raising=False)
    monkeypatch.setattr(host_memory, "_FREED_BLOCK_MIN_BYTES", 4096)
    monkeypatch.setattr(host_memory, "_POISON_LENT_BLOCKS", True)
    cfg = config("gpt", offload_param=offload_param, offload_optimizer="nvme", nvme_path=str(disk_dir), clip=clip,
                 dtype=dtype, grad_accum=grad_accum, extra_zero={"host_budget_bytes": 256 * MIB})  # fmt: skip
    before = freed_block_stats()
    result = train_on_rank("gpt", cfg, steps=3, micro_bs=2)
    assert not native.installed()  # the engine gave its hold up at close
    assert freed_block_stats()["hits"] - before["hits"] >= 30  # reused blocks were lent, poisoned, many times
    assert_matches_plain_pytorch([result], "gpt", 3, 2, grad_accum=grad_accum, clip=clip, dtype=dtype)
