"""CollectiveBuffers: a buffer is lent again only once nothing else holds it, a flat's storage gets a kept
buffer's memory and gives it back, and real Gloo gathers and reductions running in reused memory are exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist import run_distributed
from harness import config
from toy_models import batches, make_model

import infinity
from infinity.comm import CollectiveBuffers, CommGroup

pytestmark = pytest.mark.unit
pytest_plugins = ["storage_fixtures"]  # disk_dir: a directory on a disk that takes O_DIRECT

CPU = torch.device("cpu")


def test_the_private_torch_apis_the_pool_relies_on_behave_as_it_assumes_on_this_torch():
    from infinity.comm import buffers

    assert buffers._private_apis_behave() and CollectiveBuffers().enabled


def test_a_buffer_nobody_holds_is_lent_again_and_one_still_held_is_not():
    buffers = CollectiveBuffers()
    first = buffers.take(1000, torch.float32, CPU)
    address = first.data_ptr()
    kept = first.narrow(0, 10, 20)  # what a caller might keep: a view of the buffer
    del first
    second = buffers.take(1000, torch.float32, CPU)
    assert second.data_ptr() != address  # `kept` still shares the first buffer
    del kept, second
    third = buffers.take(1000, torch.float32, CPU)
    assert third.data_ptr() == address
    assert buffers.kept_bytes == 2 * 1000 * 4


def test_buffers_are_lent_by_size_in_bytes():
    buffers = CollectiveBuffers()
    a = buffers.take(1000, torch.float32, CPU)
    a_address = a.data_ptr()
    del a
    b = buffers.take(999, torch.float32, CPU)
    assert b.data_ptr() != a_address and b.numel() == 999
    c = buffers.take(2000, torch.bfloat16, CPU)  # 4000 bytes, as the free fp32 one
    assert c.data_ptr() == a_address and (c.dtype, c.numel()) == (torch.bfloat16, 2000)
    del b, c
    buffers.clear()
    assert buffers.kept_bytes == 0


def test_a_flats_storage_is_filled_with_a_kept_buffer_and_drained_back_and_its_views_see_the_memory():
    buffers = CollectiveBuffers()
    full = torch.arange(8, dtype=torch.float32)
    view = full[2:6].view(2, 2)  # a view autograd saved in forward
    storage = full.untyped_storage()
    buffers.drain(storage)  # memory the pool never gave (a flat's before its first gather): freed
    assert storage.nbytes() == 0 and buffers.kept_bytes == 0
    buffers.fill(storage, 32)  # gathered: new memory
    address = full.data_ptr()
    buffers.drain(storage)  # resharded: the memory goes into the pool
    assert storage.nbytes() == 0 and buffers.kept_bytes == 32
    buffers.fill(storage, 32)  # gathered again: the same memory, in the same storage object
    assert full.data_ptr() == address and buffers.kept_bytes == 0
    full.copy_(torch.arange(8, dtype=torch.float32) * 10)
    assert view.tolist() == [[20.0, 30.0], [40.0, 50.0]]
    buffers.fill(torch.empty(0).untyped_storage(), 64)  # no kept buffer of that size: new memory
    with pytest.raises(ValueError, match="empty storage"):
        buffers.fill(storage, 32)


def test_a_lent_buffer_is_not_moved_into_a_flat():
    buffers = CollectiveBuffers()
    lent = buffers.take(8, torch.float32, CPU)
    storage = torch.empty(0).untyped_storage()
    buffers.fill(storage, 32)
    assert storage.data_ptr() != lent.data_ptr()


def test_the_pool_keeps_no_more_than_was_filled_at_once():
    buffers = CollectiveBuffers()
    storages = [torch.UntypedStorage(0) for _ in range(3)]
    for storage in storages:
        buffers.fill(storage, 64)
    for storage in storages:
        buffers.drain(storage)
    assert buffers.kept_bytes == 3 * 64
    for _ in range(4):  # one at a time from now on: the same buffer each time, nothing new
        buffers.fill(storages[0], 64)
        buffers.drain(storages[0])
    assert buffers.kept_bytes == 3 * 64
    buffers.drain(torch.empty(16).untyped_storage())  # never filled: not kept
    assert buffers.kept_bytes == 3 * 64


def test_switched_off_it_keeps_nothing():
    buffers = CollectiveBuffers()
    storage = torch.UntypedStorage(0)
    buffers.fill(storage, 32)
    buffers.stop_keeping()
    buffers.drain(storage)
    buffers.take(8, torch.float32, CPU)
    assert storage.nbytes() == 0 and buffers.kept_bytes == 0


SHARD = 4096


def _full(rank: int, world: int, round_: int) -> torch.Tensor:
    return torch.arange(world * SHARD, dtype=torch.float32) * (rank + 1) + 1000.0 * rank + round_


def _collectives_in_reused_memory(world: int) -> list[str]:
    """Three rounds, each: two reductions in flight (inputs and receive buffers lent by the group's pool, as
    the gradient reducer takes them) and a gather into a flat's storage filled from the pool. Every sum and
    gather is exact, and later rounds run in the earlier rounds' memory."""
    rank = dist.get_rank()
    comm = CommGroup(rank, world, dist.group.WORLD)
    failures, kept = [], []
    flat = torch.empty(world * SHARD)
    for round_ in range(3):
        pending = []
        for i in range(2):
            full = comm.buffers.take(world * SHARD, torch.float32, CPU)
            full.copy_(_full(rank, world, round_) * (i + 1))
            pending.append(comm.reduce_scatter_in_background(full, f"round {round_} reduction {i}"))
        for i, (shard, work) in enumerate(pending):
            work.wait()
            expected = sum(_full(r, world, round_) for r in range(world)).narrow(0, rank * SHARD, SHARD) * (i + 1)
            if not torch.equal(shard, expected):
                failures.append(f"round {round_} reduction {i} differs")
        del pending, shard, work, full
        comm.buffers.drain(flat.untyped_storage())
        comm.buffers.fill(flat.untyped_storage(), world * SHARD * 4)
        comm.all_gather(flat, torch.full((SHARD,), float(rank + round_)), f"round {round_} gather")
        if not torch.equal(flat, torch.arange(world).repeat_interleave(SHARD).float() + round_):
            failures.append(f"round {round_} gather differs")
        kept.append(comm.buffers.kept_bytes)
    if kept[1] != kept[2]:  # (the flat's first memory was not the pool's: round 0 fills it anew)
        failures.append(f"the pool grew over the rounds: {kept}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_gathers_and_reductions_in_reused_memory_are_exact(world):
    assert run_distributed(_collectives_in_reused_memory, world, world, timeout_s=60) == [[]] * world


def test_an_aligned_buffer_starts_on_the_boundary_covers_the_padding_and_is_lent_again_once_dropped():
    from infinity.storage import ALIGN, aligned_view

    buffers = CollectiveBuffers()
    for numel in (1, 1000, 1024, 5000):
        lent = buffers.take(numel, torch.float32, CPU, align=ALIGN)
        assert lent.numel() == numel and lent.data_ptr() % ALIGN == 0
        assert aligned_view(lent) is not None  # direct I/O writes it in place
        address = lent.data_ptr()
        del lent
        assert buffers.take(numel, torch.float32, CPU, align=ALIGN).data_ptr() == address


def test_a_lending_limit_keeps_the_latest_buffers_lent_and_leaves_the_gathers_own_alone():
    buffers = CollectiveBuffers()
    buffers.limit_lending(2)
    storage = torch.UntypedStorage(0)
    buffers.fill(storage, 64)
    buffers.drain(storage)  # a gather's buffer: kept whatever the limit
    held = [buffers.take(16, torch.float32, CPU) for _ in range(4)]  # four in use at once: all lent
    addresses = [t.data_ptr() for t in held]
    assert buffers.kept_bytes == 64 + 4 * 64
    del held
    smaller = buffers.take(8, torch.float32, CPU)
    assert smaller.data_ptr() in addresses  # a free buffer large enough is lent again, not fresh memory
    assert buffers.kept_bytes == 64 + 2 * 64  # and the free ones beyond the limit go
    tiny = buffers.take(7, torch.float32, CPU)  # a free one holds it, but more than twice over: new memory
    assert tiny.data_ptr() not in addresses
    del tiny
    larger = buffers.take(32, torch.float32, CPU)  # none fits: new, and the free ones beyond the limit go
    assert larger.data_ptr() not in addresses
    assert buffers.kept_bytes == 64 + 64 + 128  # the gather's, the one still lent, the new one
    del smaller, larger
    storage = torch.UntypedStorage(0)
    buffers.fill(storage, 64)  # the gather's buffer was never lent
    assert buffers.kept_bytes == 64 + 128


def test_a_lending_limit_of_zero_lends_fresh_memory_and_keeps_what_gathers_drained():
    buffers = CollectiveBuffers()
    buffers.limit_lending(0)
    lent = buffers.take(8, torch.float32, CPU)
    del lent
    assert buffers.kept_bytes == 0  # `take` lent fresh memory, gone with its tensor
    storage = torch.UntypedStorage(0)
    buffers.fill(storage, 64)
    address = storage.data_ptr()
    buffers.drain(storage)
    assert buffers.kept_bytes == 64
    again = torch.UntypedStorage(0)
    buffers.fill(again, 64)
    assert again.data_ptr() == address and buffers.kept_bytes == 0  # the gather reused it
    buffers.take(16, torch.uint8, CPU)
    assert buffers.kept_bytes == 0


@pytest.mark.parametrize("budget", [None, 1 << 30])
def test_the_engine_keeps_gathered_memory_and_reuses_one_ranks_gradient_flats(budget, disk_dir):
    """One rank with parameters and optimizer on NVMe gathers (copies) every block; its memory stays in the
    pool between uses, with a host budget too (the gather window is in the plan). The gradient flats the
    clipped step waits for (written to NVMe under a budget, held in memory without) are 4 KiB-aligned and
    come from the same few buffers every step; under a budget the pool keeps no more of them than its plan
    counts."""
    from infinity.storage import ALIGN

    extra_zero = {} if budget is None else {"host_budget_bytes": budget}
    cfg = config("mlp", offload_param="nvme", offload_optimizer="nvme", nvme_path=str(disk_dir), clip=1.0,
                 extra_zero=extra_zero)  # fmt: skip
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=cfg)
    flats: list[set[int]] = []
    accumulate = engine.shards.accumulate_grad

    def spy(flat, grad, final):
        flats[-1].add(grad.data_ptr())
        return accumulate(flat, grad, final)

    engine.shards.accumulate_grad = spy
    try:
        assert engine.comm.buffers.kept_bytes == 0  # the flats' memory from before sharding was freed
        window = engine.optimizer.stepper.window  # the plan's: waiting flats are half of it
        assert engine.comm.buffers.lend_limit == (None if budget is None else max(1, window // 2) + 2)
        x, y = next(batches("mlp", 2))
        for _ in range(4):
            flats.append(set())
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        assert engine.shards.placement.optim_home.value == "nvme" and all(flats)
        assert all(address % ALIGN == 0 for step in flats for address in step)
        # no fresh memory for the last step's gradients (under a budget they are recomputed for their step, the
        # first step's on trial: the second step's replays are the first to hold theirs until stepped)
        assert flats[3] <= flats[0] | flats[1] | flats[2]
        assert engine.comm.buffers.enabled and engine.comm.buffers.kept_bytes > 0  # between steps
    finally:
        engine.close()
