"""On a GPU: the engine against plain PyTorch on the same GPU, the gradient bytes that cross to the host, and
no op of a step mixing host and device memory.

Marked `cuda`: skipped where no GPU exists (conftest), run by `make gpu-check`. Worlds: one rank, and one
rank per GPU when the machine has several (NCCL). Tolerances are the harness's (`assert_matches_reference`),
with the reference trained on the same GPU.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from device_check import DeviceMixCheck
from dist import run_distributed
from harness import (
    assert_matches_plain_pytorch,
    assert_matches_reference,
    assert_weights_close,
    config,
    reference_for,
    train_on_rank,
    train_steps,
)
from toy_models import batches, dropout_gpt, make_model

import infinity

pytestmark = pytest.mark.cuda

STEPS = 4
MICRO_BS = 2

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = [1, GPUS] if GPUS > 1 else [1]
MATRIX = list(itertools.product(WORLDS, ["none", "cpu", "nvme"], ["fp32", "bf16"], [1, 2]))


def _run(
    tmp_path, world: int, offload: str, dtype: str, grad_accum: int, clip: float = 1.0, host_budget: int | None = None
) -> list[dict]:
    cfg = config(
        micro_bs=MICRO_BS,
        persistence=64,
        grad_accum=grad_accum,
        offload_param=offload,
        offload_optimizer=offload,
        dtype=dtype,
        clip=clip,
        nvme_path=str(tmp_path),
        extra_zero={"host_budget_bytes": host_budget},
    )
    return run_distributed(  # one rank runs without a process group, as without a launcher
        train_on_rank, world, "gpt", cfg, STEPS, MICRO_BS, timeout_s=300, backend="nccl", init_process_group=world > 1
    )


def _check_against_pytorch_on_the_gpu(results: list[dict], grad_accum: int, clip: float, dtype: str):
    cuda0 = torch.device("cuda", 0)
    assert_matches_plain_pytorch(
        results, "gpt", STEPS, MICRO_BS, grad_accum=grad_accum, clip=clip, dtype=dtype, device=cuda0
    )


@pytest.mark.parametrize("world,offload,dtype,grad_accum", MATRIX)
def test_gpt_on_the_gpu_matches_plain_pytorch(tmp_path, world, offload, dtype, grad_accum):
    results = _run(tmp_path, world, offload, dtype, grad_accum)
    _check_against_pytorch_on_the_gpu(results, grad_accum, 1.0, dtype)
    for r in results:  # offloaded optimizers get each micro-batch's gradient shards, in the compute dtype
        expected = STEPS * grad_accum * r["trainable_shard_elems"] * (2 if dtype == "bf16" else 4)
        assert r["bytes_moved"].get("device->host", 0) == (0 if offload == "none" else expected)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("host_budget", [256 << 20, None])
def test_the_unclipped_nvme_optimizer_on_the_gpu_matches_plain_pytorch(tmp_path, world, host_budget):
    """Under a host budget each shard steps as its gradient arrives; without one, its gradient waits in host
    memory and the step runs before the next forward (`memory_plan.balance_step_timing`)."""
    results = _run(tmp_path, world, "nvme", "bf16", 1, clip=0.0, host_budget=host_budget)
    _check_against_pytorch_on_the_gpu(results, 1, 0.0, "bf16")
    if host_budget is None:
        assert all(r["stepped_in_backward"] == 0 and r["stepped_when_needed"] > 0 for r in results)
    else:
        assert all(r["stepped_in_backward"] > 0 for r in results)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_clipped_nvme_steps_recompute_gradients_on_the_gpu_as_plain_pytorch(tmp_path, world, dtype):
    """Clipped under a host budget, each block's gradient is recomputed on the GPU for its deferred step: the first
    step's trial passes with the GPU's rounding (no block rejected), and training matches plain PyTorch."""
    results = _run(tmp_path, world, "nvme", dtype, 1, host_budget=256 << 20)
    _check_against_pytorch_on_the_gpu(results, 1, 1.0, dtype)
    assert all(r["replay_rejected"] == {} and r["replayed"] > 0 for r in results)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_experts_without_a_gradient_are_not_stepped_on_the_gpu(tmp_path, world, offload):
    """An expert no row reached gets no step (`optim.param_steps`), with the presence of each parameter's
    gradient all-reduced over NCCL where there are several GPUs."""
    cfg = config("experts", micro_bs=MICRO_BS, block_classes=("ExpertLayer",), offload_param=offload,
                 offload_optimizer=offload, nvme_path=str(tmp_path))  # fmt: skip
    nccl = {"timeout_s": 300, "backend": "nccl", "init_process_group": world > 1}
    results = run_distributed(train_on_rank, world, "experts", cfg, STEPS, MICRO_BS, **nccl)
    ref = reference_for("experts", STEPS, MICRO_BS * world, device=torch.device("cuda", 0))
    assert_matches_reference(results, ref.losses, ref.state)


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
def test_no_op_of_a_step_mixes_host_and_device_memory(tmp_path, offload):
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = config(
        micro_bs=MICRO_BS, persistence=64, grad_accum=2, offload_param=offload, offload_optimizer=offload,
        dtype="bf16", nvme_path=str(tmp_path),
    )  # fmt: skip
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    data = batches("gpt", MICRO_BS)
    try:
        with DeviceMixCheck(device) as check:
            for _ in range(2 * engine.gradient_accumulation_steps):
                x, y = next(data)  # CPU batches: the engine moves them
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            torch.cuda.synchronize()
    finally:
        engine.close()
    assert check.ops > 0
    assert check.violations == []


def _recompute_config(path: str, dtype: str, recompute: bool) -> dict:
    """Both offloads on NVMe under a host budget, clipped: the step is deferred and, with `recompute`, each
    block's gradient is recomputed for it instead of waiting on NVMe."""
    os.makedirs(path, exist_ok=True)
    nvme = {"device": "nvme", "nvme_path": path, "recompute_gradients": recompute}
    return config(
        micro_bs=MICRO_BS, persistence=64, offload_param="nvme", offload_optimizer="nvme", dtype=dtype, clip=1.0,
        nvme_path=path, extra_zero={"host_budget_bytes": 256 << 20, "offload_optimizer": nvme},
    )  # fmt: skip


def _train_here(model: torch.nn.Module, cfg: dict, steps: int) -> dict:
    """Train `model` on this process's GPU, seeding every generator (the CUDA one draws dropout) after set-up."""
    engine, _, _, _ = infinity.initialize(model=model, config=cfg)
    torch.manual_seed(1)
    try:
        losses = train_steps(engine, batches("gpt", MICRO_BS), steps)
        state = engine.full_state_dict()
        replay = engine.grad_replay  # None with recompute_gradients off
        replayed, rejected = (replay.replayed_blocks, dict(replay.rejected)) if replay is not None else (0, {})
        return {"losses": losses, "state": state, "replayed": replayed, "rejected": rejected}
    finally:
        engine.close()


def _assert_same_training(on: dict, off: dict, dtype: str) -> None:
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-5 if dtype == "fp32" else 2e-2)
    assert_weights_close(on["state"], off["state"], dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_replay_on_the_gpu_draws_the_same_dropout_masks(tmp_path, dtype):
    """Dropout on the GPU draws from the CUDA generator: the replay restores the state its block's forward began
    from, so every trial passes (a different mask would fail it) and the run is the one whose gradients waited
    on NVMe, to the GPU's rounding."""
    on = _train_here(dropout_gpt(), _recompute_config(str(tmp_path / "on"), dtype, True), STEPS)
    off = _train_here(dropout_gpt(), _recompute_config(str(tmp_path / "off"), dtype, False), STEPS)
    assert on["rejected"] == {} and on["replayed"] > 0 and off["replayed"] == 0
    _assert_same_training(on, off, dtype)


def test_fp16_on_the_gpu_recomputes_the_loss_scaled_gradients(tmp_path):
    """fp16 with dynamic loss scaling (no clipping; the overflow check defers the step): replays recompute the
    scaled gradients, the overflowing first steps owe none, and the run is the one whose gradients waited on
    NVMe."""
    runs = []
    for recompute in (True, False):
        cfg = _recompute_config(str(tmp_path / str(recompute)), "fp32", recompute)
        cfg["gradient_clipping"] = 0.0
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 3, "hysteresis": 1}
        torch.manual_seed(0)
        runs.append(_train_here(make_model("gpt"), cfg, 6))
    on, off = runs
    assert on["rejected"] == {} and on["replayed"] > 0 and off["replayed"] == 0
    _assert_same_training(on, off, "fp16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset_bytes", [0, 256, 4, 12])
def test_a_weight_gradient_made_in_a_piece_of_a_gpu_flat_is_the_one_autograd_makes(dtype, offset_bytes):
    """A replay makes a weight's product in its piece of the hand-over flat where `_fits` allows (on a GPU, at
    a 256-byte aligned address): there it must have autograd's bits; at other addresses it is made apart, and
    this says whether cuBLAS would have given the same bits there too (the guard's reason)."""
    from infinity.scheduler.linear_factors import _fits, weight_grad

    torch.manual_seed(0)
    linear = torch.nn.Linear(768, 3072, bias=False, device="cuda", dtype=dtype)
    x = torch.randn(2, 16, 768, device="cuda", dtype=dtype)
    y = linear(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    skip = offset_bytes // x.element_size()
    flat = torch.full((skip + linear.weight.numel(),), float("nan"), device="cuda", dtype=dtype)
    piece = flat[skip:].view_as(linear.weight)
    assert _fits(piece, x) == (offset_bytes % 256 == 0)
    weight_grad(x, dy, out=piece)
    if _fits(piece, x):
        assert torch.equal(piece, linear.weight.grad)
    else:  # made apart in the replay; report what in place would have given
        assert torch.isfinite(piece).all()
        print(f"unaligned by {offset_bytes} bytes: bit-equal {torch.equal(piece, linear.weight.grad)}")
