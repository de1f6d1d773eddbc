"""The scheduler's prefetch: which blocks it gathers ahead of compute, in what order, and when it stops.

Real layers throughout: a model of `Step` blocks sharded by `shard_model` into a `ShardStore` whose
parameter shards live on NVMe (a direct-I/O file under a temp dir), so every fetch is a real asynchronous
read. The scheduler talks to the store through `RecordingSource`, which passes each call on unchanged
and notes it; for the gather-queue test it also reports one block's fetch as unfinished (a slow disk for
that block: the bytes still come from the store).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from harness import config, placement_of
from torch import nn

from infinity.comm import CommGroup
from infinity.config import AioConfig
from infinity.engine.sharding import shard_model
from infinity.partition import FlatParam, plan_blocks
from infinity.partition.sharded_block import BlockState, ShardedBlock
from infinity.scheduler import BlockScheduler
from infinity.shards import ShardKind, ShardStore
from infinity.storage import Tier, TierBudgets, TierStore

pytestmark = pytest.mark.unit
pytest_plugins = ["storage_fixtures"]  # disk_dir: a directory on a disk that takes O_DIRECT

S = 1024  # elements of one small block: one aligned shard, no padding


class Step(nn.Module):
    """A block of `numel` weights; forward adds the first few of them to its input."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(numel) / 100)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[-1]]


class Chain(nn.Module):
    """Steps run in `order` (which a test may change between passes); returns a scalar loss."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.steps = nn.ModuleList(Step(n) for n in sizes)
        self.order = list(range(len(sizes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.steps[i](x)
        return x.square().sum()


class _HeldFetch:
    """A real fetch whose done() says False: its block's shard counts as not arrived. wait() really waits."""

    def __init__(self, handle) -> None:
        self._handle = handle

    def done(self) -> bool:
        return False

    def wait(self) -> torch.Tensor:
        return self._handle.wait()


class RecordingSource:
    """The shard store, with each call the scheduler makes noted as (verb, block index or indices)."""

    def __init__(self, store: ShardStore, block_of: dict[str, int], held: frozenset[int] = frozenset()) -> None:
        self.store = store
        self.block_of = block_of
        self.held = held
        self.calls: list[tuple[str, object]] = []

    def fetch_param(self, flat: FlatParam):
        index = self.block_of[flat.name]
        self.calls.append(("fetch", index))
        handle = self.store.fetch_param(flat)
        return _HeldFetch(handle) if index in self.held else handle

    def release_param(self, flat: FlatParam, keep: bool = False) -> None:
        self.calls.append(("gathered", self.block_of[flat.name]))  # one rank: the gather is done at its issue
        self.store.release_param(flat, keep)

    def read_ahead(self, flats: list[FlatParam]) -> None:
        self.calls.append(("read_ahead", [self.block_of[f.name] for f in flats]))
        self.store.read_ahead(flats)


@dataclass
class Use:
    """What compute found when a block started computing (seen right after the scheduler's pre-hook)."""

    block: int
    held: list[int]  # the other blocks holding gathered memory, or on their way
    states: dict[int, tuple[BlockState, bool]]  # every block's state, and whether its fetch has arrived
    host_bytes: int  # live bytes in the store's host tier


@dataclass
class Run:
    model: Chain
    scheduler: BlockScheduler
    source: RecordingSource
    blocks: list[ShardedBlock]
    store: ShardStore
    uses: list[list[Use]] = field(default_factory=list)  # per pass, in order

    def forward(self, order: list[int] | None = None, grad: bool = False) -> None:
        """One pass (a forward, and with `grad` its backward) in `order` (default: the last one)."""
        if order is not None:
            self.model.order = order
        self.uses.append([])
        self.source.calls.append(("pass", len(self.uses) - 1))
        x = torch.ones(4, 8)
        if not grad:
            with torch.no_grad():
                self.model(x)
            return
        loss = self.model(x)
        self.source.calls.append(("backward", len(self.uses) - 1))
        self.scheduler.begin_backward()
        loss.backward()
        self.scheduler.finish_backward()

    def use(self, pass_index: int, block: int) -> Use:
        """`block`'s first use in pass `pass_index`."""
        return next(u for u in self.uses[pass_index] if u.block == block)

    def held(self, pass_index: int, block: int) -> list[int]:
        return self.use(pass_index, block).held

    def calls(self, pass_index: int, verb: str, backward: bool = False) -> list:
        """What pass `pass_index` (its forward, or its backward) did of `verb`, in order."""
        calls = self.source.calls
        start = calls.index(("backward" if backward else "pass", pass_index)) + 1
        end = next((i for i in range(start, len(calls)) if calls[i][0] in ("pass", "backward")), len(calls))
        return [what for v, what in calls[start:end] if v == verb]

    def close(self) -> None:
        self.scheduler.remove_hooks()
        self.store.close()


def _run(
    directory,
    sizes: list[int],
    bucket: int,
    max_live: int = 10**9,
    reuse: int = 0,
    held: frozenset[int] = frozenset(),
    trainable: bool = False,
) -> Run:
    """`Chain(sizes)` sharded into a store with its parameter shards on NVMe under `directory`, its blocks
    scheduled with these limits (elements); `held` blocks' fetches never report themselves arrived."""
    placement = placement_of(config(block_classes=("Step",), offload_param="nvme", nvme_path=str(directory)))
    assert placement.param_home is Tier.NVME and placement.gather_from is Tier.HOST
    tiers = TierStore(str(directory), AioConfig(), TierBudgets())
    comm = CommGroup(0, 1)
    store = ShardStore(tiers, placement, comm)
    model = Chain(sizes)
    plan = plan_blocks(model, ("Step",), 0, 0)
    group_of = {id(p): 0 for p in model.parameters()} if trainable else {}
    blocks, root, persistent = shard_model(model, plan, group_of, store, comm, sub_group_elems=10**9)
    source = RecordingSource(store, {f.name: b.index for b in blocks for f in b.flats}, held)

    def drop_grads(block: ShardedBlock) -> None:
        for flat in block.flats:
            flat.clear_grads()

    scheduler = BlockScheduler(
        model,
        blocks,
        root,
        persistent,
        source,
        drop_grads,
        prefetch_bucket_elems=bucket,
        max_live_elems=max_live,
        max_reuse_distance_elems=reuse,
    )
    run = Run(model, scheduler, source, blocks, store)

    def note(block: ShardedBlock):
        def hook(module, args) -> None:  # registered after the scheduler's: sees what it just decided
            held = [b.index for b in blocks if b is not block and b.holds_memory]
            states = {b.index: (b.state, b.fetched()) for b in blocks}
            run.uses[-1].append(Use(block.index, held, states, tiers.live_bytes(Tier.HOST)))

        return hook

    for block in blocks:
        block.module.register_forward_pre_hook(note(block))
    return run


def test_the_first_pass_records_the_order_and_prefetches_nothing(disk_dir):
    run = _run(disk_dir, [S] * 4, bucket=2 * S)
    run.forward()
    assert [run.held(0, b) for b in range(4)] == [[], [], [], []]
    assert run.calls(0, "fetch") == [0, 1, 2, 3] == run.calls(0, "gathered")  # each when compute reaches it
    assert run.calls(0, "read_ahead") == []
    assert run.scheduler.forward_trace.order == [0, 1, 2, 3]
    run.close()


def test_the_next_blocks_within_the_bucket_are_prefetched_in_trace_order(disk_dir):
    run = _run(disk_dir, [S] * 6, bucket=2 * S)
    run.forward()
    run.forward()
    assert run.held(1, 0) == [1, 2]
    assert run.calls(1, "fetch") == [0, 1, 2, 3, 4, 5]  # every block fetched once, in the order it runs
    assert all(block in run.held(1, block - 1) for block in range(1, 6))  # each on its way before its use
    run.close()


def test_blocks_ahead_of_compute_never_hold_more_than_the_bucket(disk_dir):
    """The bucket bounds what is gathered ahead of compute at any time (`gathered_bytes_bound`), not only
    what one prefetch adds: blocks still in flight from the last prefetch count against it."""
    run = _run(disk_dir, [S] * 8, bucket=3 * S)
    run.forward()
    run.forward()
    for block in range(8):
        assert run.held(1, block) == list(range(block + 1, min(block + 4, 8))), block
    run.close()


def test_prefetch_stops_at_max_live_parameters(disk_dir):
    run = _run(disk_dir, [S] * 6, bucket=10 * S, max_live=3 * S)
    run.forward()
    run.forward()
    assert run.held(1, 0) == [1, 2]  # the block computing counts: two more fit
    for block in range(6):
        assert S * (1 + len(run.held(1, block))) <= 3 * S, block
    run.close()


def test_a_non_zero_bucket_always_takes_the_next_block(disk_dir):
    run = _run(disk_dir, [S, 4 * S, S, S], bucket=1)  # one element: smaller than any block
    run.forward()
    run.forward()
    assert run.held(1, 0) == [1]  # four times the bucket, taken anyway
    assert run.held(1, 1) == [2]  # and only the next one
    run.close()


def test_the_next_block_is_not_taken_past_max_live_parameters(disk_dir):
    run = _run(disk_dir, [S, 4 * S, S], bucket=1, max_live=2 * S)
    run.forward()
    run.forward()
    assert run.held(1, 0) == []
    assert run.calls(1, "read_ahead")[0] == [1, 2]  # read ahead instead
    run.close()


def test_a_zero_bucket_prefetches_nothing_and_reads_every_later_block_ahead(disk_dir):
    run = _run(disk_dir, [S] * 4, bucket=0)
    run.forward()
    run.forward()
    assert [run.held(1, b) for b in range(4)] == [[], [], [], []]
    assert run.calls(1, "read_ahead") == [[1, 2, 3], [2, 3], [3]]
    run.close()


def test_blocks_beyond_the_bucket_are_read_ahead_into_host_memory(disk_dir):
    run = _run(disk_dir, [S] * 6, bucket=2 * S)
    run.forward()
    run.forward()
    assert run.calls(1, "read_ahead")[0] == [3, 4, 5]  # at block 0: 1 and 2 are gathered, the rest read ahead
    # in host memory at block 0: the three shards read ahead (S fp32 elements each), and the two prefetched
    # ones unless their gathers, issued as they arrive, dropped them already
    assert 3 * S * 4 <= run.use(1, 0).host_bytes <= 5 * S * 4
    assert run.use(0, 0).host_bytes == 0  # the first pass: block 0's shard was gathered and dropped
    run.close()


def test_the_reuse_distance_keeps_a_block_gathered_until_its_next_use(disk_dir):
    order = [0, 1, 0, 2]  # block 0 runs again after block 1 (S elements later)
    for name in ("kept", "freed"):
        (disk_dir / name).mkdir()
    kept = _run(disk_dir / "kept", [S] * 3, bucket=0, reuse=S)
    freed = _run(disk_dir / "freed", [S] * 3, bucket=0, reuse=S - 1)
    for run in (kept, freed):
        run.forward(order)
        run.forward()
    assert kept.held(0, 1) == []  # the first pass has no trace to measure the distance with
    assert kept.held(1, 1) == [0] and kept.calls(1, "fetch") == [0, 1, 2]  # block 0 gathered once
    assert freed.held(1, 1) == [] and freed.calls(1, "fetch") == [0, 1, 0, 2]
    assert all(b.state is BlockState.SHARDED for b in kept.blocks)  # the pass's end frees it anyway
    kept.close()
    freed.close()


def test_gathers_are_issued_in_queue_order_whatever_order_the_shards_arrive_in(disk_dir):
    run = _run(disk_dir, [S] * 5, bucket=3 * S, held=frozenset({1}))
    run.forward()
    for index in (2, 3):  # blocks 2 and 3 cached in host memory: their next fetches arrive at once
        key = run.store.key(run.blocks[index].flats[0], ShardKind.PARAM)
        run.store.tiers.fetch(key, Tier.HOST).wait()
        run.store.tiers.release(key, Tier.HOST)
    run.forward()
    at_block_0 = run.use(1, 0).states
    assert at_block_0[1] == (BlockState.FETCHING, False)  # the slow one
    assert at_block_0[2] == at_block_0[3] == (BlockState.FETCHING, True)  # arrived, waiting behind block 1
    assert run.calls(1, "fetch")[:4] == [0, 1, 2, 3]
    assert run.calls(1, "gathered") == [0, 1, 2, 3, 4]
    run.close()


def test_a_changed_order_invalidates_the_trace_and_prefetch_resumes_from_the_new_recording(disk_dir):
    run = _run(disk_dir, [S] * 4, bucket=2 * S)
    run.forward([0, 1, 2, 3])
    run.forward()
    assert run.held(1, 0) == [1, 2]
    run.forward([0, 2, 3])  # block 1 skipped: the trace holds at block 0, then no longer
    trace = run.scheduler.forward_trace
    assert trace.invalidations == 1 and trace.order == [0, 2, 3]
    assert run.held(2, 0) == [1, 2]  # prefetched from the old order before the difference showed
    assert run.calls(2, "fetch") == [0, 1, 2, 3]  # nothing prefetched after it: block 3 fetched at its use
    assert all(b.state is BlockState.SHARDED for b in run.blocks)  # the unused prefetch was freed
    run.forward()
    assert run.held(3, 0) == [2, 3]  # the new order is prefetched
    assert run.calls(3, "fetch") == [0, 2, 3] and run.scheduler.forward_trace.invalidations == 1
    run.close()


def test_backward_prefetches_in_the_reverse_order_it_recorded(disk_dir):
    run = _run(disk_dir, [S] * 4, bucket=S, trainable=True)
    run.forward(grad=True)
    run.forward(grad=True)
    assert run.scheduler.backward_trace.order == [3, 2, 1, 0]
    assert run.calls(0, "fetch", backward=True) == [3, 2, 1, 0]  # recording: each at its use
    # block 3 stays gathered from its forward (backward's first block, 0 elements apart): not fetched again
    assert run.calls(1, "fetch", backward=True) == [2, 1, 0]
    assert run.calls(1, "read_ahead", backward=True)[0] == [1, 0]  # at block 3: 2 is gathered, 1 and 0 read
    run.close()


def test_blocks_backwards_first_prefetch_would_gather_stay_gathered_from_their_forward(disk_dir):
    """With a recorded backward, the blocks its first prefetch takes (the first block of backward and the
    bucket after it) are not resharded after their forward: each is fetched once per step, and no more is
    gathered at the turn than backward's first prefetch holds."""
    run = _run(disk_dir, [S] * 5, bucket=2 * S, reuse=10**9, trainable=True)
    run.forward(grad=True)
    run.forward(grad=True)
    run.forward(grad=True)
    assert run.calls(0, "fetch", backward=True) == [4, 3, 2, 1, 0]  # no backward recorded yet: all again
    for step in (1, 2):
        assert run.calls(step, "fetch") == [0, 1, 2, 3, 4]
        assert run.calls(step, "fetch", backward=True) == [1, 0]
    assert run.use(2, 4).held == [2, 3]  # at the last block of forward: the two kept before it
    assert run.scheduler.gathered_high_water_bytes <= 3 * S * 4  # the block computing and the bucket
    assert all(b.state is BlockState.SHARDED for b in run.blocks)  # backward's end frees them
    run.close()


def test_a_reuse_distance_of_zero_keeps_only_the_first_block_of_backward(disk_dir):
    run = _run(disk_dir, [S] * 4, bucket=2 * S, reuse=0, trainable=True)
    run.forward(grad=True)
    run.forward(grad=True)
    assert run.calls(1, "fetch", backward=True) == [2, 1, 0]
    run.close()


def test_a_forward_without_gradients_keeps_nothing_for_backward(disk_dir):
    run = _run(disk_dir, [S] * 4, bucket=2 * S, reuse=10**9, trainable=True)
    run.forward(grad=True)
    run.forward(grad=True)
    run.forward()  # no_grad: no backward follows
    assert run.use(1, 3).held == [1, 2]  # with gradients: kept for backward (3 first, then 2 and 1 in 2S)
    assert run.use(2, 3).held == []  # without: each resharded after its forward
    assert all(b.state is BlockState.SHARDED for b in run.blocks)
    run.close()
