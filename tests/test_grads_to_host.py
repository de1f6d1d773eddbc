"""Gradients crossing from the device to the host in the compute dtype, and new weights crossing back,
on a CPU-only machine whose device tier stands apart (`device_budget_bytes`), as a GPU's does.

The bytes are counted (`engine.bytes_moved["device->host"]`): every micro-batch each trainable shard
crosses once, in bf16 half the bytes of fp32. Results match plain PyTorch, also with the copy stream
simulated to run late (`simulate_async_copies`): every wait for a copy is then a real wait, and one
missing shows as wrong weights.
"""

from __future__ import annotations

import pytest
from dist import run_distributed
from harness import assert_matches_plain_pytorch, config, train_on_rank

from infinity.storage.streams import simulate_async_copies

STEPS = 4
MICRO_BS = 2
DEVICE_BUDGET = 64 << 20  # the device tier apart from the host, ample for the tiny GPT


def _config(tmp_path, offload_param: str, offload_optimizer: str, dtype: str, grad_accum: int, clip: float = 1.0):
    return config(
        micro_bs=MICRO_BS,
        persistence=64,
        grad_accum=grad_accum,
        offload_param=offload_param,
        offload_optimizer=offload_optimizer,
        dtype=dtype,
        clip=clip,
        nvme_path=str(tmp_path),
        extra_zero={"device_budget_bytes": DEVICE_BUDGET},
    )


def _train_with_late_copies(delay_s: float, *args) -> dict:
    with simulate_async_copies(delay_s):
        return train_on_rank(*args)


def _expected_grad_bytes(result: dict, dtype: str, grad_accum: int) -> int:
    return STEPS * grad_accum * result["trainable_shard_elems"] * (2 if dtype == "bf16" else 4)


@pytest.mark.parametrize(
    "world,offload_param,offload_optimizer,dtype,grad_accum",
    [
        (1, "cpu", "cpu", "bf16", 1),
        (1, "none", "cpu", "bf16", 2),  # new weights cross up to parameters resident in device memory
        (2, "cpu", "cpu", "bf16", 2),
        (1, "nvme", "nvme", "bf16", 2),  # the accumulator on NVMe: promoted to fp32 before its write
        (1, "cpu", "cpu", "fp32", 1),
        (2, "none", "cpu", "fp32", 2),
    ],
)
def test_gradients_cross_in_the_compute_dtype_counted_and_matching_plain_pytorch(
    tmp_path, world, offload_param, offload_optimizer, dtype, grad_accum
):
    cfg = _config(tmp_path, offload_param, offload_optimizer, dtype, grad_accum)
    results = run_distributed(train_on_rank, world, "gpt", cfg, STEPS, MICRO_BS, timeout_s=180)
    assert_matches_plain_pytorch(results, "gpt", STEPS, MICRO_BS, grad_accum=grad_accum, dtype=dtype)
    for result in results:
        assert result["bytes_moved"]["device->host"] == _expected_grad_bytes(result, dtype, grad_accum)


def test_the_nvme_optimizer_stepping_as_gradients_arrive_takes_them_in_bf16(tmp_path):
    """No clipping: each shard is stepped as its gradient arrives, by the native Adam from bf16 gradients."""
    cfg = _config(tmp_path, "none", "nvme", "bf16", 1, clip=0.0)
    results = run_distributed(train_on_rank, 1, "gpt", cfg, STEPS, MICRO_BS, timeout_s=180)
    assert_matches_plain_pytorch(results, "gpt", STEPS, MICRO_BS, clip=0.0, dtype="bf16")
    assert results[0]["stepped_in_backward"] > 0
    assert results[0]["bytes_moved"]["device->host"] == _expected_grad_bytes(results[0], "bf16", 1)


def test_without_a_device_apart_no_gradient_bytes_cross():
    cfg = config(micro_bs=MICRO_BS, persistence=64, offload_param="cpu", offload_optimizer="cpu", dtype="bf16")
    results = run_distributed(train_on_rank, 1, "gpt", cfg, STEPS, MICRO_BS, timeout_s=180)
    assert "device->host" not in results[0]["bytes_moved"]  # the compute reads host memory: nothing crosses


@pytest.mark.parametrize(
    "world,offload_param,offload_optimizer,grad_accum,clip",
    [(1, "cpu", "cpu", 2, 1.0), (1, "none", "cpu", 1, 1.0), (2, "nvme", "nvme", 2, 1.0), (1, "none", "nvme", 1, 0.0)],
)
def test_copies_landing_late_still_match_plain_pytorch(
    tmp_path, world, offload_param, offload_optimizer, grad_accum, clip
):
    """The copy stream runs every copy 5 ms late: shards fetched to the device, gradients down, weights up."""
    cfg = _config(tmp_path, offload_param, offload_optimizer, "bf16", grad_accum, clip)
    results = run_distributed(_train_with_late_copies, world, 0.005, "gpt", cfg, STEPS, MICRO_BS, timeout_s=240)
    assert_matches_plain_pytorch(results, "gpt", STEPS, MICRO_BS, grad_accum=grad_accum, clip=clip, dtype="bf16")
