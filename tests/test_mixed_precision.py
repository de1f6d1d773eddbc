"""bf16 and fp16 runs against the same mixed precision emulated in plain PyTorch, tightly enough that a mistake fails.

The reference (mixed_precision_reference.py) runs the same tiny GPT in bf16/fp16 from the same weights,
sums fp32 gradients, clips by the global norm, steps fp32 masters with torch's AdamW and, for fp16, applies
DeepSpeed's dynamic loss scale rules written out independently. Compared per step: the loss scale and the
skipped steps (exactly), the unscaled gradient norm, the loss; at the end the fp32 masters and AdamW's two
moments of every parameter.

Tolerances. Both sides start from identical weights and compute identical bf16/fp16 forward and backward
passes; they part only where an fp32 master differs in its last bit (the norm is summed in another order, the
AdamW kernels order their operations differently) and that flips a 16-bit rounding, after which the runs
drift apart by 16-bit ulps. Measured here (6 steps, 1 and 2 ranks, in-memory/CPU/NVMe optimizers): masters
within a mean of 3e-5 (bf16) / 3e-6 (fp16) and a max of 1.4e-3 / 1.6e-4, moments within 3.1e-2 / 1.7e-3
relative (L2, per tensor), norms within 5.1e-4 / 6e-5 relative. The bounds below sit about 3x above those,
and at least 3.7x below the smallest effect of each mistake in `MUTATIONS` (no weight decay moves the masters'
mean by 3.7e-4 in fp16, beta2 0.99 the second moments by 9x, no clipping and unscaled gradients the
moments by 500x and more, a skipped step everything); `test_each_mistake_fails_the_comparison` proves it by
running each one.
"""

from __future__ import annotations

import functools
import math
import tempfile

import pytest
import torch
from dist import run_distributed
from mixed_precision_cases import BETAS, CLIP, EPS, FP16, LR, MUTATIONS, WEIGHT_DECAY, train_mixed
from mixed_precision_reference import DynamicScale, MixedRun, train_mixed_reference
from toy_models import batches, make_model

STEPS = 6
MICRO_BS = 2
# dtype -> (loss rtol, masters mean |diff|, masters max |diff|, moments relative L2, norm rtol)
BOUNDS = {"bf16": (2e-2, 1e-4, 5e-3, 0.1, 5e-3), "fp16": (5e-3, 2e-5, 5e-4, 1e-2, 5e-4)}


@functools.cache
def _reference(dtype: str, world: int, grad_accum: int) -> MixedRun:
    scale = None
    if dtype == "fp16":
        scale = DynamicScale(2.0 ** FP16["initial_scale_power"], FP16["loss_scale_window"], FP16["hysteresis"])
    return train_mixed_reference(
        lambda: make_model("gpt"),
        batches("gpt", MICRO_BS * world),
        STEPS,
        dtype=torch.bfloat16 if dtype == "bf16" else torch.float16,
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        clip=CLIP,
        grad_accum=grad_accum,
        loss_scale=scale,
    )


@functools.cache
def _run(dtype: str, world: int, offload: str, grad_accum: int, mutation: str | None = None) -> tuple:
    with tempfile.TemporaryDirectory() as nvme:
        args = (dtype, STEPS, MICRO_BS, grad_accum, offload, mutation, nvme)
        return tuple(run_distributed(train_mixed, world, *args, timeout_s=120))


def _assert_matches_reference(dtype: str, results: tuple, ref: MixedRun) -> None:
    loss_rtol, mean_tol, max_tol, moment_tol, norm_rtol = BOUNDS[dtype]
    first = results[0]
    assert first["scales"] == ref.scales, "loss scale per step"
    assert first["skipped"] == ref.skipped, "skipped steps"
    for step, (norm, ref_norm) in enumerate(zip(first["norms"], ref.grad_norms, strict=True)):
        if math.isinf(ref_norm):
            assert math.isinf(norm), f"step {step}: the reference overflowed"
        else:
            assert norm == pytest.approx(ref_norm, rel=norm_rtol), f"step {step}: unscaled gradient norm"
    losses = [sum(r["losses"][i] for r in results) / len(results) for i in range(STEPS)]
    assert losses == pytest.approx(ref.losses, rel=loss_rtol)
    diffs = torch.cat([(first["state"][k] - v).abs().reshape(-1) for k, v in ref.state.items()])
    assert diffs.mean().item() <= mean_tol, f"masters: mean |diff| {diffs.mean().item():.3g}"
    assert diffs.max().item() <= max_tol, f"masters: max |diff| {diffs.max().item():.3g}"
    for name, ref_moments in ref.moments.items():
        for which, mine, theirs in zip(("m", "v"), first["moments"][name], ref_moments, strict=True):
            rel = ((mine - theirs).norm() / theirs.norm()).item()
            assert rel <= moment_tol, f"{name} {which}: relative difference {rel:.3g}"
    for other in results[1:]:
        for key, value in first["state"].items():
            assert torch.equal(other["state"][key], value), key


RUNS = [(1, "none", 1), (1, "cpu", 2), (2, "nvme", 2), (2, "none", 1)]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("world,offload,grad_accum", RUNS)
def test_mixed_precision_matches_its_plain_pytorch_emulation(dtype, world, offload, grad_accum):
    _assert_matches_reference(dtype, _run(dtype, world, offload, grad_accum), _reference(dtype, world, grad_accum))


def test_the_fp16_run_skips_steps_and_moves_its_scale_both_ways():
    """The comparison above covers the dynamic scale's rules: overflow at 2^16, halving, doubling after the
    window, and overflowing again."""
    ref = _reference("fp16", 1, 1)
    assert ref.skipped.count(True) >= 2 and not all(ref.skipped)
    moves = [b - a for a, b in zip(ref.scales, ref.scales[1:], strict=False)]
    assert any(m > 0 for m in moves) and any(m < 0 for m in moves)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_each_mistake_fails_the_comparison(dtype, mutation):
    with pytest.raises(AssertionError):
        _assert_matches_reference(dtype, _run(dtype, 1, "none", 1, mutation), _reference(dtype, 1, 1))
