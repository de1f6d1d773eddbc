"""Parameters read outside their block (issue 15): gathered when read, released after, prefetched next step.

The models (external_params_cases.py) read a block's weight from the parent's forward, from another block,
and through a block's submodule called by the parent, with no change made for infinity. Parameters and
optimizer live on NVMe so every block is really released between uses (one rank with in-memory shards
would keep them resident). Tolerances are the harness's fp32 ones (`assert_matches_reference`).
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch
from dist import run_distributed
from external_params_cases import build_external, external_batches, external_config, inference_external, train_external
from harness import Reference, assert_matches_reference, reference_for, reference_train

STEPS = 4
MICRO_BS = 2
DEFAULT_REUSE = 1_000_000_000


@functools.cache
def _run(kind: str, world: int, reuse_distance: int) -> tuple:
    with tempfile.TemporaryDirectory() as nvme:
        cfg = external_config(kind, MICRO_BS, nvme, reuse_distance)
        return tuple(run_distributed(train_external, world, kind, cfg, STEPS, MICRO_BS, timeout_s=120))


def _reference(kind: str, world: int) -> Reference:
    if kind.startswith("gpt"):
        return reference_for("gpt_functional_tie", STEPS, MICRO_BS * world)
    return reference_train(lambda: build_external(kind), external_batches(kind, MICRO_BS * world), STEPS)


def _assert_matches_plain_pytorch(kind: str, world: int, results: tuple) -> None:
    ref = _reference(kind, world)
    assert_matches_reference(list(results), ref.losses, ref.state)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("reuse_distance", [0, DEFAULT_REUSE])
def test_head_reading_the_embedding_blocks_weight_matches_plain_pytorch(world, reuse_distance):
    """`F.linear(x, self.wte.weight)` in the parent, `wte` a block: released after its forward (reuse distance
    0) or kept for its next use (the default), the weights and losses are plain PyTorch's."""
    kind = "gpt_head_reads_embedding"
    _assert_matches_plain_pytorch(kind, world, _run(kind, world, reuse_distance))


@pytest.mark.parametrize("world", [1, 2])
def test_blocks_reading_each_others_weights_match_plain_pytorch(world):
    _assert_matches_plain_pytorch("peer_reads", world, _run("peer_reads", world, 0))


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_a_block_read_before_its_own_forward_matches_plain_pytorch(tmp_path, clip):
    """layers[0] reads layers[3]'s weight: that read's gradient arrives after layers[3]'s backward is over, so
    layers[3]'s gradients must wait for it (without clipping, under a host budget, its shards step as their
    gradients arrive: a second reduction would step them twice)."""
    cfg = external_config("peer_reads_ahead", MICRO_BS, str(tmp_path), 0)
    cfg["gradient_clipping"] = clip
    cfg["zero_optimization"]["host_budget_bytes"] = 256 << 20
    results = run_distributed(train_external, 2, "peer_reads_ahead", cfg, STEPS, MICRO_BS, timeout_s=120)
    ref = reference_train(lambda: build_external("peer_reads_ahead"), external_batches("peer_reads_ahead", 4), STEPS,
                          clip=clip)  # fmt: skip
    assert_matches_reference(list(results), ref.losses, ref.state)


def test_a_read_outside_the_block_enters_the_trace_where_it_happens():
    for result in _run("gpt_head_reads_embedding", 2, 0):
        assert result["order"] == ["wte", "wpe", "blocks.0", "blocks.1", "wte"]
        assert result["invalidations"] == 0
    for result in _run("peer_reads", 2, 0):
        # layers.2 reads layers.0; the parent reads layers.1's weight (an argument of layers.3, evaluated
        # before the call), then calls layers.1.fc: one read of layers.1 within the root's call
        assert result["order"] == ["layers.0", "layers.1", "layers.2", "layers.0", "layers.1", "layers.3"]
        assert result["invalidations"] == 0


@pytest.mark.parametrize("world", [1, 2])
def test_a_block_read_from_outside_is_prefetched_from_the_second_step(world):
    """Released after its own forward (reuse distance 0), the embedding block is already on its way when the
    head is about to read it, once the trace holds the read (every step after the first)."""
    for result in _run("gpt_head_reads_embedding", world, 0):
        assert result["prefetched"] == [False] + [True] * (STEPS - 1)


@pytest.mark.parametrize("kind", ["gpt_head_reads_embedding", "peer_reads"])
def test_no_block_stays_gathered_after_a_step(kind):
    for result in _run(kind, 2, 0):
        assert result["gathered_after"] == []


@pytest.mark.parametrize("kind", ["gpt_head_reads_embedding", "peer_reads"])
def test_inference_reading_blocks_from_outside_equals_the_plain_model(tmp_path, kind):
    cfg = external_config(kind, MICRO_BS, str(tmp_path), 0)
    results = run_distributed(inference_external, 2, kind, cfg, timeout_s=120)
    plain = build_external(kind)
    for rank, result in enumerate(results):
        x, _ = next(external_batches(kind, MICRO_BS, rank, 2))
        with torch.no_grad():
            expected = plain(x)[0]
        torch.testing.assert_close(result["output"], expected, rtol=1e-5, atol=1e-6)
        assert result["gathered_after"] == []
