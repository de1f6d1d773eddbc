"""DeepSpeed's communication and optimizer-pipeline keys each change what the run does, and never its result.

`communication_data_type`, `overlap_comm` with `reduce_bucket_size`, `allgather_bucket_size`,
`sub_group_size`, `offload_optimizer.pipeline_read` / `pipeline_write`: for each, a measurable effect
(bytes on the wire, reductions in flight, collectives per step, flats, host memory) and the losses and
weights of plain PyTorch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist import run_distributed
from harness import assert_matches_reference, assert_weights_close, config, reference_for, train_on_rank, train_steps
from toy_models import batches, make_model

import infinity
from infinity.storage import Tier

STEPS = 3
MICRO_BS = 2


def _traced(cfg: dict, trace_dir: str) -> dict:
    cfg = {**cfg, "profiler": {"enabled": True, "path": trace_dir, "start_step": 0, "end_step": STEPS - 1}}
    return cfg


def _collectives(trace_dir: Path, rank: int = 0) -> list[dict]:
    lines = (trace_dir / f"trace_rank{rank}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == "collective"]


def reducer_probe(cfg: dict) -> dict:
    """Train STEPS steps on this rank; also the most reductions that were in flight at once."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    in_flight = []
    complete = engine.reducer._complete_oldest

    def counted() -> None:  # observes the reducer; changes nothing it does
        in_flight.append(len(engine.reducer._in_flight))
        complete()

    engine.reducer._complete_oldest = counted
    losses = train_steps(engine, batches("gpt", MICRO_BS, rank=rank, world_size=world), STEPS)
    out = {"losses": losses, "state": engine.full_state_dict(), "max_in_flight": max(in_flight)}
    engine.close()
    return out


@pytest.mark.parametrize(
    "zero,expect_overlap",
    [({"overlap_comm": False}, False), ({"overlap_comm": True}, True), ({"reduce_bucket_size": 1}, False)],
)
def test_overlap_comm_keeps_reductions_in_flight_within_the_bucket(zero, expect_overlap):
    cfg = config(micro_bs=MICRO_BS, persistence=64, offload_optimizer="cpu", extra_zero=zero)
    results = run_distributed(reducer_probe, 2, cfg, timeout_s=120)
    ref = reference_for("gpt", STEPS, 2 * MICRO_BS)
    assert_matches_reference(results, ref.losses, ref.state)
    # a bucket of one element (or no overlap) completes each reduction before the next is issued
    assert (results[0]["max_in_flight"] > 1) == expect_overlap


def test_communication_data_type_sets_the_bytes_gradients_cross_ranks_in(tmp_path):
    """bf16 training reduces gradients in bf16 by default (as DeepSpeed) and in fp32 when asked: half the
    bytes; both train like plain PyTorch's mixed precision."""
    sent = {}
    for comm_dtype in (None, "fp32"):
        trace = tmp_path / str(comm_dtype)
        cfg = config(micro_bs=MICRO_BS, persistence=64, dtype="bf16", extra={"communication_data_type": comm_dtype})
        results = run_distributed(train_on_rank, 2, "gpt", _traced(cfg, str(trace)), STEPS, MICRO_BS)
        ref = reference_for("gpt", STEPS, 2 * MICRO_BS, dtype=torch.bfloat16)
        assert_matches_reference(results, ref.losses, ref.state, "bf16")
        sent[comm_dtype] = sum(r["bytes"] for r in _collectives(trace) if r["op"] == "reduce-scatter")
    assert sent[None] * 2 == sent["fp32"] > 0


def test_allgather_bucket_size_sets_how_many_collectives_share_the_updated_partitions(tmp_path):
    """Stage 2: after each step the updated partitions are all-gathered, in buckets of at most
    allgather_bucket_size elements that never span blocks (each block's weights arrive by themselves,
    behind the next forward): one collective per block, or one per flat (sub_group_size splits each
    block into several flats)."""
    ref = reference_for("gpt", STEPS, 2 * MICRO_BS)
    per_step = {}
    for bucket in (10**9, 1):
        cfg = config(
            micro_bs=MICRO_BS, persistence=64, offload_optimizer="cpu",
            extra_zero={"stage": 2, "allgather_bucket_size": bucket, "sub_group_size": 4096},
        )  # fmt: skip
        trace = tmp_path / str(bucket)
        results = run_distributed(train_on_rank, 2, "gpt", _traced(cfg, str(trace)), STEPS, MICRO_BS)
        assert_matches_reference(results, ref.losses, ref.state)
        gathers = [r for r in _collectives(trace) if r["op"] == "all-gather"]
        # step k's sharing arrives in step k + 1's forward (the last step's after the trace ends)
        assert {r["step"] for r in gathers} == set(range(1, STEPS)) and {r["phase"] for r in gathers} == {"forward"}
        per_step[bucket] = [[r["block"] for r in gathers if r["step"] == step] for step in range(1, STEPS)]
    flats = per_step[1][0]  # one collective per flat, named by it: "<block>#<i>"
    blocks = list(dict.fromkeys(name.split("#")[0] for name in flats))
    assert len(flats) > len(blocks) and all(names == flats for names in per_step[1])
    assert all([name.split("#")[0] for name in names] == blocks for names in per_step[10**9])


def test_sub_group_size_splits_the_optimizers_unit_and_trains_alike(tmp_path):
    whole = config(micro_bs=MICRO_BS, persistence=64, offload_param="nvme", offload_optimizer="nvme",
                   nvme_path=str(tmp_path))  # fmt: skip
    split = json.loads(json.dumps(whole))
    split["zero_optimization"]["sub_group_size"] = 4096
    counts = []
    for cfg in (whole, split):
        engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
        counts.append((len(engine.flats), max(f.shard_numel for f in engine.shards.records)))
        engine.close()
    (flats_whole, unit_whole), (flats_split, unit_split) = counts
    assert flats_split > flats_whole and unit_split < unit_whole
    ref = reference_for("gpt", STEPS, MICRO_BS)
    assert_matches_reference([train_on_rank("gpt", split, STEPS, MICRO_BS)], ref.losses, ref.state)


def test_pipeline_read_and_write_false_hold_one_shard_at_a_time(tmp_path):
    """Without read-ahead and write-behind the NVMe optimizer holds one shard's state in host memory at a
    time; with them (the default), several. Plain PyTorch's weights either way, bit for bit the same."""
    peaks, states = [], []
    for pipelined in (True, False):
        cfg = config(micro_bs=MICRO_BS, persistence=64, offload_optimizer="nvme", nvme_path=str(tmp_path))
        cfg["zero_optimization"]["offload_optimizer"].update(pipeline_read=pipelined, pipeline_write=pipelined)
        engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
        x, y = next(batches("gpt", MICRO_BS))
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.tiers.reset_high_water(Tier.HOST)
        engine.step()
        engine.shards.settle_all()  # the deferred (clipped) step runs here, all of it
        peaks.append(engine.tiers.high_water_bytes(Tier.HOST))
        largest = max(f.shard_numel for f in engine.shards.records)
        states.append(engine.full_state_dict())
        engine.close()
    one_shard = 16 * largest + 2 * 4096  # master, moments and gradient; padding of its slots
    assert peaks[1] <= one_shard < peaks[0]
    assert all(torch.equal(states[0][k], v) for k, v in states[1].items())
    assert_weights_close(states[0], reference_for("gpt", 1, MICRO_BS).state)
