"""CommGroup's collectives over real Gloo groups of several processes: results in rank order, in place."""

from __future__ import annotations

import torch
import torch.distributed as dist
from dist import run_distributed

from infinity.comm import CommGroup

SHARD = 5  # odd on purpose: no slot boundary falls on a vector width


def _shard_of(rank: int) -> torch.Tensor:
    return torch.arange(SHARD, dtype=torch.float32) + 100.0 * (rank + 1)


def _expected(ranks: list[int]) -> torch.Tensor:
    return torch.cat([_shard_of(r) for r in ranks])


def _gathers(world: int) -> list[str]:
    """Every way the engine calls all_gather: sync, async, and a shard that is already a view of its own slot."""
    rank = dist.get_rank()
    comm = CommGroup(rank, world, dist.group.WORLD)
    failures = []

    full = torch.full((world * SHARD,), -1.0)
    address = full.data_ptr()
    assert comm.all_gather(full, _shard_of(rank), "a sync gather") is None
    if not torch.equal(full, _expected(list(range(world)))) or full.data_ptr() != address:
        failures.append(f"sync: {full.tolist()}")

    full = torch.full((world * SHARD,), -1.0)
    shard = _shard_of(rank)
    work = comm.all_gather(full, shard, "an async gather", async_op=True)
    work.wait()
    if not work.is_completed() or not torch.equal(full, _expected(list(range(world)))):
        failures.append(f"async: {full.tolist()}")

    full = torch.full((world * SHARD,), -1.0)
    mine = full[rank * SHARD : (rank + 1) * SHARD]
    mine.copy_(_shard_of(rank))
    comm.all_gather(full, mine, "a gather from its own slot", async_op=True).wait()
    if not torch.equal(full, _expected(list(range(world)))):
        failures.append(f"own slot: {full.tolist()}")
    return failures


def test_all_gather_fills_every_slot_in_rank_order_on_two_and_three_ranks():
    for world in (2, 3):
        assert run_distributed(_gathers, world, world, timeout_s=60) == [[]] * world


def _subgroup_gather() -> list[float] | None:
    """Ranks 1 and 2 of three gather in their own group: group rank 0 is global rank 1."""
    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    comm = CommGroup(dist.get_rank(group), 2, group)
    full = torch.empty(2 * SHARD)
    comm.all_gather(full, _shard_of(rank), "a subgroup's gather", async_op=True).wait()
    return full.tolist()


def test_all_gather_in_a_subgroup_maps_group_ranks_to_global_ranks():
    results = run_distributed(_subgroup_gather, 3, timeout_s=60)
    assert results[0] is None
    assert results[1] == results[2] == _expected([1, 2]).tolist()


def _refusal(op: str) -> str:
    """What rank's CommGroup says to an all-gather into a wrong size ("gather") or a reduce-scatter of an input
    that does not split evenly ("reduce-scatter"); "no error" if it takes it."""
    comm = CommGroup(dist.get_rank(), 2, dist.group.WORLD)
    try:
        if op == "gather":
            comm.all_gather(torch.empty(2 * SHARD + 1), _shard_of(dist.get_rank()), "a gather into the wrong size")
        else:
            comm.reduce_scatter_in_background(torch.ones(2 * SHARD + 1), "gradients of an uneven flat")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_an_output_of_the_wrong_size_is_refused_on_every_rank_naming_the_gather():
    for rank, message in enumerate(run_distributed(_refusal, 2, "gather", timeout_s=60)):
        assert message.startswith(f"rank {rank}/2: all-gather of a gather into the wrong size: the output holds 11")
        assert "not 2 x 5" in message


def _full_of(rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s input to a reduce-scatter: distinct values per rank and slot, exact in fp32 sums."""
    return torch.arange(world * SHARD, dtype=torch.float32) * (rank + 1) + 1000.0 * rank


def _background_reduce_scatters(world: int) -> list[str]:
    """Two reductions in flight at once (as backward issues them), waited for in order; and one whose peers'
    slices all arrived before the wait (is_completed) must still be summed once, not twice."""
    rank = dist.get_rank()
    comm = CommGroup(rank, world, dist.group.WORLD)
    expected = sum(_full_of(r, world) for r in range(world)).narrow(0, rank * SHARD, SHARD)
    failures = []
    fulls = [_full_of(rank, world), _full_of(rank, world) * 2]
    pending = [comm.reduce_scatter_in_background(full, f"gradients {i}") for i, full in enumerate(fulls)]
    for i, (shard, work) in enumerate(pending):
        work.wait()
        work.wait()
        if not torch.equal(shard, expected * (i + 1)):
            failures.append(f"reduction {i}: {shard.tolist()} != {(expected * (i + 1)).tolist()}")
        if shard.data_ptr() != fulls[i].narrow(0, rank * SHARD, SHARD).data_ptr():
            failures.append(f"reduction {i}: the shard is not this rank's slice of its input")
    shard, work = comm.reduce_scatter_in_background(_full_of(rank, world), "gradients polled")
    while not work.is_completed():
        pass
    work.wait()
    if not torch.equal(shard, expected):
        failures.append(f"polled: {shard.tolist()}")
    return failures


def test_reduce_scatter_in_background_sums_each_slice_on_its_rank_on_two_and_three_ranks():
    for world in (2, 3):
        assert run_distributed(_background_reduce_scatters, world, world, timeout_s=60) == [[]] * world


def _subgroup_reduce_scatter() -> list[float] | None:
    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    comm = CommGroup(dist.get_rank(group), 2, group)
    shard, work = comm.reduce_scatter_in_background(_full_of(rank, 2), "a subgroup's gradients")
    work.wait()
    return shard.tolist()


def test_reduce_scatter_in_a_subgroup_sends_to_global_ranks():
    results = run_distributed(_subgroup_reduce_scatter, 3, timeout_s=60)
    total = _full_of(1, 2) + _full_of(2, 2)
    assert results[0] is None
    assert results[1] == total[:SHARD].tolist() and results[2] == total[SHARD:].tolist()


def test_a_reduce_scatter_input_that_does_not_split_evenly_is_refused_naming_it():
    for rank, message in enumerate(run_distributed(_refusal, 2, "reduce-scatter", timeout_s=60)):
        assert message.startswith(f"rank {rank}/2: reduce-scatter of gradients of an uneven flat: the input holds 11")
