"""Parameters and optimizer on NVMe under a host budget: every step reads the least the configuration
allows.

With the step during backward: each parameter shard once for forward, once more in backward, where the
gather's host copy is also the step's master (one NVMe slot), and the moments once. The first step has no
recorded order, so nothing is read ahead; later steps read the next blocks ahead in backward, and that
read-ahead must not evict the copies the step is about to read.

With clipping, the step waits for the global norm and runs before the next forward's gather of each
shard: it reads the master (the parameter shard), the moments and the gradient that waited on NVMe, and
the gather reads the new weights from the step's host copy; backward reads each shard once more. With
bf16 compute the step writes the new 16-bit weights into a host copy of the parameter shard made without
reading it, which the gather reads in the same way."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from harness import assert_weights_close, config, reference_train, train_steps
from toy_models import SEQ, batches

import infinity
from infinity.models.gpt import GPT, gpt_preset
from infinity.shards import ShardKind

STEPS = 4
BUCKET = 150_000  # elements: three blocks


def _nvme_bytes(engine, kind: ShardKind) -> int:
    """The bytes of every trainable shard's `kind` (stored on NVMe, as the store reads them back)."""
    store = engine.shards
    total = 0
    for flat in store.records:
        assert store.tiers.location(store.key(flat, kind)) is not None  # on NVMe
        total += store.read(flat, kind).numel() * (4 if kind is ShardKind.PARAM else 1)
    return total


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_preset("small", block_size=SEQ, bias=False, n_layer=16, n_embd=64))


def _engine(tmp_path, host_budget_mib: int | None, clip: float, dtype: str = "fp32", recompute: bool = True):
    model = _model()
    cfg = config(
        micro_bs=2,
        persistence=64,
        offload_param="nvme",
        offload_optimizer="nvme",
        clip=clip,
        dtype=dtype,
        nvme_path=str(tmp_path),
        extra_zero={
            "host_budget_bytes": None if host_budget_mib is None else host_budget_mib << 20,
            "stage3_prefetch_bucket_size": BUCKET,
            "stage3_max_live_parameters": 2 * BUCKET,
            "sub_group_size": 15_000,
        },
    )
    cfg["zero_optimization"]["offload_optimizer"]["recompute_gradients"] = recompute
    engine, *_ = infinity.initialize(model=model, config=cfg)
    return engine


def _reads_per_step(engine) -> list[int]:
    data = batches("gpt", 2)
    read = []
    for _ in range(STEPS):
        before = engine.bytes_moved.get("nvme->host", 0)
        train_steps(engine, data, 1)
        read.append(engine.bytes_moved["nvme->host"] - before)
    return read


@pytest.mark.parametrize("host_budget_mib", [4, 5, 8, None])  # None: the budget the offload settings imply
def test_every_step_reads_each_shard_for_forward_and_once_more_for_backward_and_step(tmp_path, host_budget_mib):
    engine = _engine(tmp_path, host_budget_mib, clip=0.0)
    try:
        # without a budget the step is deferred into the next forward (memory_plan.balance_step_timing): the
        # same reads, the master's by the step instead of by backward's gather
        budgeted = host_budget_mib is not None
        assert engine.placement.step_in_backward == budgeted and engine.placement.master_is_param
        read = _reads_per_step(engine)
        assert (engine.optimizer.stepped_in_backward > 0) == budgeted
        assert (engine.optimizer.stepped_when_needed > 0) == (not budgeted)
        params, moments = _nvme_bytes(engine, ShardKind.PARAM), _nvme_bytes(engine, ShardKind.MOMENTS)
        if budgeted:
            assert read == [2 * params + moments] * STEPS
        else:
            # deferred (balance_step_timing): the first step's state is read in the next forward, every later
            # one's in its own backward, in the order the window learnt; and here backward's parameter copies
            # mostly stay in host memory until the step reads them as masters
            assert sum(read) <= STEPS * (2 * params + moments) and read[-1] < 2 * params + moments, read
    finally:
        engine.close()


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("host_budget_mib", [4, 5])
def test_a_clipped_step_before_the_gather_hands_the_gather_its_new_weights(tmp_path, host_budget_mib, dtype, recompute):
    """Each parameter shard is read from NVMe at most twice a step in fp32: by the step (as its master) and by
    the backward gather; with bf16 compute (a 16-bit shard apart from the master) once, by the backward
    gather. The forward gather after the step reads the step's host copy (and backward's gather finds it
    still cached where the budget leaves room: no read at all). With the gradients recomputed for the step
    (`recompute_gradients`), its replay reads the old weights once more where backward's copy did not
    survive the budget until then (whether it does depends on which writes have finished when the budget
    reclaims room). The weights the gathers handed on are the step's: training is plain PyTorch's."""
    engine = _engine(tmp_path, host_budget_mib, clip=1.0, dtype=dtype, recompute=recompute)
    most = (2 if dtype == "fp32" else 1) + int(recompute)
    try:
        assert not engine.placement.step_in_backward
        assert engine.placement.master_is_param == (dtype == "fp32")
        assert (engine.grad_replay is not None) == recompute
        reads: Counter = Counter()
        count = engine.moves.record

        def record(event) -> None:  # observes every move, then counts it as before
            if event.src == "nvme" and event.key[-1] == ShardKind.PARAM.value:
                reads[event.key] += 1
            count(event)

        engine.moves.record = record
        data = batches("gpt", 2)
        losses = train_steps(engine, data, 1)  # the first step: nothing is owed before its forward
        assert reads  # its forward read every shard (the reads are counted)
        for _ in range(STEPS - 1):
            reads.clear()
            losses += train_steps(engine, data, 1)
            assert max(reads.values(), default=0) <= most, reads.most_common(3)
        assert engine.optimizer.stepped_when_needed > 0
        assert (engine.grad_replay is not None and engine.grad_replay.replayed_blocks > 0) == recompute
        state = engine.full_state_dict()
    finally:
        engine.close()
    ref = reference_train(_model, batches("gpt", 2), STEPS, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    assert losses == pytest.approx(ref.losses, rel=1e-5 if dtype == "fp32" else 2e-2)
    assert_weights_close(state, ref.state, dtype)
