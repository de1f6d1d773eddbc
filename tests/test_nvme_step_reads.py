"""With the step during backward, fp32, parameters and optimizer on NVMe under a host budget, every step
reads the least the configuration allows: each parameter shard once for forward, once more in backward,
where the gather's host copy is also the step's master (one NVMe slot), and the moments once.

The first step has no recorded order, so nothing is read ahead; later steps read the next blocks ahead
in backward, and that read-ahead must not evict the copies the step is about to read."""

from __future__ import annotations

import pytest
import torch
from harness import config, train_steps
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


@pytest.mark.parametrize("host_budget_mib", [4, 5, 8, None])  # None: the budget the offload settings imply
def test_every_step_reads_each_shard_for_forward_and_once_more_for_backward_and_step(tmp_path, host_budget_mib):
    torch.manual_seed(0)
    model = GPT(gpt_preset("small", block_size=SEQ, bias=False, n_layer=16, n_embd=64))
    cfg = config(
        micro_bs=2,
        persistence=64,
        offload_param="nvme",
        offload_optimizer="nvme",
        clip=0.0,
        nvme_path=str(tmp_path),
        extra_zero={
            "host_budget_bytes": None if host_budget_mib is None else host_budget_mib << 20,
            "stage3_prefetch_bucket_size": BUCKET,
            "stage3_max_live_parameters": 2 * BUCKET,
            "sub_group_size": 15_000,
        },
    )
    engine, *_ = infinity.initialize(model=model, config=cfg)
    try:
        assert engine.placement.step_in_backward and engine.placement.master_is_param
        data = batches("gpt", 2)
        read = []
        for _ in range(STEPS):
            before = engine.bytes_moved.get("nvme->host", 0)
            train_steps(engine, data, 1)
            read.append(engine.bytes_moved["nvme->host"] - before)
        assert engine.optimizer.stepped_in_backward > 0
        params, moments = _nvme_bytes(engine, ShardKind.PARAM), _nvme_bytes(engine, ShardKind.MOMENTS)
        assert read == [2 * params + moments] * STEPS
    finally:
        engine.close()
