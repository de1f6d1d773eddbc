"""The engine against plain PyTorch: same model, data and seed, same losses and final weights.

The tolerances (fp32: the engine differs from the reference only in summation order; bf16: both round
in bf16, Adam amplifies ulp differences) are the harness's, explained in harness.py.
"""

from __future__ import annotations

import itertools

import pytest
from dist import run_distributed
from harness import assert_matches_plain_pytorch, assert_weights_close, config, mean_losses, train_on_rank

STEPS = 4
MICRO_BS = 2


MATRIX = list(itertools.product([1, 2], ["none", "cpu"], ["none", "cpu"], ["fp32", "bf16"], [1, 2]))


@pytest.mark.parametrize("world,offload_param,offload_optimizer,dtype,grad_accum", MATRIX)
def test_gpt_matches_plain_pytorch(world, offload_param, offload_optimizer, dtype, grad_accum):
    cfg = config(
        micro_bs=MICRO_BS,
        persistence=64,
        grad_accum=grad_accum,
        offload_param=offload_param,
        offload_optimizer=offload_optimizer,
        dtype=dtype,
    )
    results = run_distributed(train_on_rank, world, "gpt", cfg, STEPS, MICRO_BS, timeout_s=120)
    assert_matches_plain_pytorch(results, "gpt", STEPS, MICRO_BS, grad_accum=grad_accum, dtype=dtype)


NVME_MATRIX = [
    (world, param, optim, dtype)
    for world in (1, 2)
    for param, optim in (("nvme", "nvme"), ("nvme", "cpu"), ("cpu", "nvme"), ("none", "nvme"))
    for dtype in ("fp32", "bf16")
]


@pytest.mark.parametrize("world,offload_param,offload_optimizer,dtype", NVME_MATRIX)
def test_gpt_with_nvme_matches_plain_pytorch(tmp_path, world, offload_param, offload_optimizer, dtype):
    cfg = config(
        micro_bs=MICRO_BS,
        persistence=64,
        grad_accum=2,
        offload_param=offload_param,
        offload_optimizer=offload_optimizer,
        dtype=dtype,
        nvme_path=str(tmp_path),
    )
    results = run_distributed(train_on_rank, world, "gpt", cfg, STEPS, MICRO_BS, timeout_s=120)
    assert_matches_plain_pytorch(results, "gpt", STEPS, MICRO_BS, grad_accum=2, dtype=dtype)
    assert not list(tmp_path.iterdir()), "the swap files are removed at shutdown"


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_gradients_waiting_on_nvme_for_the_clipped_step_are_stored_in_bf16(tmp_path, world):
    """One micro-batch reduced in bf16: the gradient the clipped step waits for is written as computed (two
    bytes an element, not four), and training still matches plain PyTorch. (Under a host budget: without
    one it waits in host memory.)"""
    cfg = config(
        micro_bs=MICRO_BS,
        persistence=64,
        offload_param="nvme",
        offload_optimizer="nvme",
        dtype="bf16",
        clip=1.0,
        nvme_path=str(tmp_path),
        extra_zero={"host_budget_bytes": 256 << 20},
    )
    results = run_distributed(train_on_rank, world, "gpt", cfg, STEPS, MICRO_BS, timeout_s=120)
    assert_matches_plain_pytorch(results, "gpt", STEPS, MICRO_BS, dtype="bf16")
    assert all(r["grad_slot_bytes_per_elem"] == 2 for r in results)


ARRIVAL_MATRIX = [*itertools.product([1, 2], ["nvme", "none"], ["fp32"], [1, 2]), (1, "nvme", "bf16", 1)]


def _unclipped_nvme(tmp_path, offload_param: str, dtype: str, grad_accum: int, host_budget: int | None) -> dict:
    return config(
        micro_bs=MICRO_BS,
        persistence=64,
        grad_accum=grad_accum,
        offload_param=offload_param,
        offload_optimizer="nvme",
        dtype=dtype,
        clip=0.0,
        nvme_path=str(tmp_path),
        extra_zero={"host_budget_bytes": host_budget},
    )


@pytest.mark.parametrize("world,offload_param,dtype,grad_accum", ARRIVAL_MATRIX)
def test_nvme_optimizer_stepped_during_backward_matches_plain_pytorch(
    tmp_path, world, offload_param, dtype, grad_accum
):
    """Without clipping or loss scaling, under a host budget, the NVMe optimizer steps each shard as its
    gradient arrives."""
    cfg = _unclipped_nvme(tmp_path, offload_param, dtype, grad_accum, host_budget=256 << 20)
    results = run_distributed(train_on_rank, world, "gpt", cfg, STEPS, MICRO_BS, timeout_s=120)
    assert_matches_plain_pytorch(results, "gpt", STEPS, MICRO_BS, grad_accum=grad_accum, clip=0.0, dtype=dtype)
    assert all(r["stepped_in_backward"] > 0 for r in results)


@pytest.mark.parametrize(
    "world,offload_param,dtype,grad_accum", [(1, "nvme", "fp32", 1), (2, "nvme", "fp32", 2), (1, "none", "bf16", 1)]
)
def test_without_a_budget_the_unclipped_nvme_step_is_deferred_and_matches_plain_pytorch(
    tmp_path, world, offload_param, dtype, grad_accum
):
    """No host budget and the gradients fit in host memory: the step runs just before each shard's next
    forward instead (`memory_plan.balance_step_timing`), still exactly plain PyTorch's unclipped step."""
    cfg = _unclipped_nvme(tmp_path, offload_param, dtype, grad_accum, host_budget=None)
    results = run_distributed(train_on_rank, world, "gpt", cfg, STEPS, MICRO_BS, timeout_s=120)
    assert_matches_plain_pytorch(results, "gpt", STEPS, MICRO_BS, grad_accum=grad_accum, clip=0.0, dtype=dtype)
    assert all(r["stepped_in_backward"] == 0 and r["stepped_when_needed"] > 0 for r in results)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_mlp_matches_plain_pytorch(world, offload):
    cfg = config("mlp_h40", micro_bs=MICRO_BS, persistence=64, offload_param=offload, offload_optimizer=offload)
    results = run_distributed(train_on_rank, world, "mlp_h40", cfg, STEPS, MICRO_BS, timeout_s=120)
    assert_matches_plain_pytorch(results, "mlp_h40", STEPS, MICRO_BS)


def test_world_size_two_matches_world_size_one():
    """The same global batch on one rank and split over two: the same run, and plain PyTorch's (without that
    anchor two equally wrong runs would agree)."""
    cfg1 = config(micro_bs=2 * MICRO_BS, persistence=64, offload_optimizer="cpu")
    cfg2 = config(micro_bs=MICRO_BS, persistence=64, offload_optimizer="cpu")
    one = run_distributed(train_on_rank, 1, "gpt", cfg1, STEPS, 2 * MICRO_BS)
    two = run_distributed(train_on_rank, 2, "gpt", cfg2, STEPS, MICRO_BS)
    assert_matches_plain_pytorch(one, "gpt", STEPS, 2 * MICRO_BS)
    assert mean_losses(two) == pytest.approx(one[0]["losses"], rel=1e-5)
    assert_weights_close(two[0]["state"], one[0]["state"])
