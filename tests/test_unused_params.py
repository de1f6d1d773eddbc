"""Parameters that get no gradient in a step are not stepped, as plain PyTorch's AdamW skips a `.grad` of None.

The model (`toy_models.ExpertNet`) routes each row to one of three experts inside each block, so in most steps
some expert of a block got no row (on one rank, or on every rank), while the others in its flat did; a root
`pooler` the loss never uses gets no gradient at all. Stepping those with a zero gradient (what DeepSpeed ZeRO-3
does) decays their moments and applies weight decay: the weights drift from plain PyTorch's. Checked against
plain PyTorch for each stepper and step timing: torch's fused AdamW (offload none), the native Adam stepping
after backward (cpu), deferred to the next forward with clipping (nvme, gradients recomputed), and stepping
as gradients arrive (nvme, no clipping); at one and two ranks; with accumulation; through a checkpoint.
"""

from __future__ import annotations

import math

import pytest
import torch
from dist import run_distributed
from harness import (
    LR,
    WEIGHT_DECAY,
    assert_matches_reference,
    assert_weights_close,
    config,
    rank_and_world,
    reference_for,
    train_on_rank,
)
from toy_models import batches, expert_route, make_model

import infinity

MICRO_BS = 2
STEPS = 6


def _experts_config(
    offload: str, nvme_path: str, clip: float = 1.0, grad_accum: int = 1, dtype: str = "fp32", **zero
) -> dict:
    return config("experts", micro_bs=MICRO_BS, grad_accum=grad_accum, clip=clip, dtype=dtype,
                  block_classes=("ExpertLayer",), offload_param=offload, offload_optimizer=offload,
                  nvme_path=nvme_path, extra_zero=zero)  # fmt: skip


def _experts_used(world: int, grad_accum: int, steps: int = STEPS) -> list[set[int]]:
    """Per step, the experts some rank routed a row to (the data decides)."""
    data = [batches("experts", MICRO_BS, rank=r, world_size=world) for r in range(world)]
    return [
        {e for r in range(world) for _ in range(grad_accum) for e in expert_route(next(data[r])[0]).tolist()}
        for _ in range(steps)
    ]


BUDGET = {"host_budget_bytes": 256 << 20}  # NVMe under a host budget: steps in backward, or gradients recomputed


@pytest.mark.parametrize(
    "world,offload,clip,grad_accum,dtype,zero,timing",
    [
        (1, "none", 1.0, 1, "fp32", {}, "after backward"),
        (1, "cpu", 1.0, 2, "fp32", {}, "after backward"),
        (1, "nvme", 1.0, 1, "fp32", BUDGET, "recomputed"),
        (1, "nvme", 0.0, 1, "fp32", BUDGET, "during backward"),
        (1, "nvme", 1.0, 2, "fp32", {}, "deferred"),
        (1, "nvme", 1.0, 1, "bf16", BUDGET, "recomputed"),
        (2, "none", 1.0, 1, "fp32", {}, "after backward"),
        (2, "none", 1.0, 1, "fp32", {"stage": 2}, "after backward"),
        (2, "cpu", 1.0, 2, "fp32", {}, "after backward"),
        (2, "none", 1.0, 1, "bf16", {"stage": 1}, "after backward"),
        (2, "nvme", 1.0, 1, "fp32", {}, "deferred"),
        (2, "nvme", 0.0, 2, "fp32", BUDGET, "during backward"),
    ],
)
def test_parameters_without_a_gradient_are_not_stepped_as_in_plain_pytorch(
    tmp_path, world, offload, clip, grad_accum, dtype, zero, timing
):
    used = _experts_used(world, grad_accum)
    # the data leaves an expert unused in some step after it was used (its moments are not zero): stepping it
    # with a zero gradient would move it
    assert any(e not in used[s] and any(e in u for u in used[:s]) for s in range(STEPS) for e in range(3)), used
    cfg = _experts_config(offload, str(tmp_path), clip, grad_accum, dtype, **zero)
    results = run_distributed(train_on_rank, world, "experts", cfg, STEPS, MICRO_BS)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    ref = reference_for("experts", STEPS, MICRO_BS * world, grad_accum=grad_accum, clip=clip, dtype=torch_dtype)
    assert_matches_reference(list(results), ref.losses, ref.state, dtype)
    initial = results[0]["initial"]
    assert torch.equal(results[0]["state"]["pooler.weight"], initial["pooler.weight"])  # never used: never stepped
    r = results[0]
    ran = {
        "during backward": r["stepped_in_backward"] > 0,
        "deferred": r["stepped_when_needed"] > 0,
        "recomputed": r["replayed"] > 0,
        "after backward": r["stepped_when_needed"] == r["stepped_in_backward"] == 0,
    }
    assert ran[timing], (timing, r["stepped_in_backward"], r["stepped_when_needed"], r["replayed"])


def _train_saving_at(cfg: dict, steps: int, save_at: int, save_dir: str) -> dict:
    """Train `save_at` steps and save; a second engine on a fresh model loads that and trains to `steps`."""
    rank, world = rank_and_world()
    data = batches("experts", MICRO_BS, rank=rank, world_size=world)
    losses, per_param_counts = [], False
    engine, _, _, _ = infinity.initialize(model=make_model("experts"), config=cfg)
    for step in range(steps):
        if step == save_at:
            per_param_counts = any(r.slot_steps is not None for r in engine.shards.records.values())
            engine.save_checkpoint(save_dir)
            engine.close()
            engine, _, _, _ = infinity.initialize(model=make_model("experts", seed=1), config=cfg)
            engine.load_checkpoint(save_dir)
        _, loss = engine(*next(data))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result = {"losses": losses, "state": engine.full_state_dict(), "per_param_counts_saved": per_param_counts}
    engine.close()
    return result


@pytest.mark.parametrize("world,offload", [(1, "cpu"), (2, "nvme")])
def test_per_parameter_step_counts_survive_a_checkpoint(tmp_path, world, offload):
    """An expert that skipped steps has fewer Adam steps (its bias correction) than its flat: the checkpoint
    keeps each parameter's count, and the resumed run matches plain PyTorch's uninterrupted one."""
    (tmp_path / "swap").mkdir()
    cfg = _experts_config(offload, str(tmp_path / "swap"))
    results = run_distributed(_train_saving_at, world, cfg, STEPS, 3, str(tmp_path / "ckpt"))
    assert all(r["per_param_counts_saved"] for r in results)
    ref = reference_for("experts", STEPS, MICRO_BS * world)
    assert_matches_reference(list(results), ref.losses, ref.state)


# -- planned routes: a block left out of the last micro-batch, gradients dropped mid-accumulation ---------------


def _routed(experts: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global micro-batch whose rows go to `experts` (one row each)."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(len(experts), 16, generator=gen), torch.randn(len(experts), 8, generator=gen)
    x[:, 0] = torch.tensor([(e + 0.25) / 2 for e in experts])
    assert expert_route(x).tolist() == experts
    return x, y


# Each step: its micro-batches as (rows' experts, skip layers[1], drop the gradients after it).
PLAN = [
    [([0, 1, 2, 0], False, False), ([2, 1, 0, 2], False, False)],  # every expert gets moments
    [([0, 0, 1, 1], False, False), ([0, 1, 2, 2], True, False)],  # layers[1] only in the first micro-batch
    [([0, 0, 0, 0], False, False), ([0, 0, 0, 0], False, False)],  # experts 1 and 2 get nothing
    [([0, 1, 2, 2], False, True), ([0, 1, 0, 1], False, False)],  # expert 2's gradient is dropped by zero_grad
]


# Rank 0's rows reach every expert of each block, rank 1's miss expert 2: rank 0's count of its blocks'
# gradients completes in backward, rank 1's never does (its reductions used to wait for the end, in module order).
UNEVEN = [[([0, 1, 2, 0, 0, 1, 0, 1], False, False)] * 2] * 3


def _micro_batches(plan: list = PLAN):
    for s, step in enumerate(plan):
        for m, (experts, skip, drop) in enumerate(step):
            yield _routed(experts, 10 * s + m), skip, drop


def _train_plan(cfg: dict, plan: list = PLAN) -> dict:
    rank, world = rank_and_world()
    n = len(plan[0][0][0]) // world
    rows = slice(rank * n, (rank + 1) * n)
    engine, _, _, _ = infinity.initialize(model=make_model("experts"), config=cfg)
    for (x, y), skip, drop in _micro_batches(plan):
        _, loss = engine(x[rows], y[rows], skip=skip)
        engine.backward(loss)
        if drop:
            engine.zero_grad()  # (the micro-batch still counts towards the accumulation, as in DeepSpeed)
        engine.step()
    state = engine.full_state_dict()  # (settles a deferred step: its replays run here)
    result = {"state": state, "replayed": engine.grad_replay.replayed_blocks if engine.grad_replay else 0}
    engine.close()
    return result


def _plain_plan(plan: list = PLAN, clip: float = 0.0) -> dict[str, torch.Tensor]:
    model = make_model("experts")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    batches = _micro_batches(plan)
    for step in plan:
        for _ in step:
            (x, y), skip, drop = next(batches)
            _, loss = model(x, y, skip=skip)
            (loss / len(step)).backward()
            if drop:
                opt.zero_grad(set_to_none=True)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world,offload,zero", [(1, "cpu", {}), (2, "none", {}), (2, "cpu", {}), (2, "nvme", BUDGET)])
def test_presence_follows_every_micro_batch_and_zero_grad(tmp_path, world, offload, zero):
    """A block left out of a step's last micro-batch still has its parameters' presence from the first (the
    ranks agree on it before the step), and gradients dropped by zero_grad take their presence with them:
    plain PyTorch's parameters whose `.grad` is None then are not stepped. Without clipping: at two ranks on
    NVMe under a budget, shards step as their gradients arrive in backward."""
    cfg = _experts_config(offload, str(tmp_path), clip=0.0, grad_accum=2, **zero)
    cfg["train_micro_batch_size_per_gpu"] = 4 // world
    results = run_distributed(_train_plan, world, cfg)
    assert_weights_close(results[0]["state"], _plain_plan())


def _resume_in_format(cfg: dict, save_dir: str, moments: str) -> dict:
    """Train 3 steps with fp32 moments and save; load that into an engine with `moments` and train 3 more."""
    data = batches("experts", MICRO_BS)
    engine, _, _, _ = infinity.initialize(model=make_model("experts"), config=cfg)
    for _ in range(3):
        _, loss = engine(*next(data))
        engine.backward(loss)
        engine.step()
    saved = {f.name: r.slot_steps for f, r in engine.shards.records.items() if r.slot_steps is not None}
    engine.save_checkpoint(save_dir)
    engine.close()
    cfg["zero_optimization"]["offload_optimizer"]["moments"] = moments
    engine, _, _, _ = infinity.initialize(model=make_model("experts"), config=cfg)
    engine.load_checkpoint(save_dir)
    losses = []
    for _ in range(3):
        _, loss = engine(*next(data))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    after = [r.slot_steps for r in engine.shards.records.values()]
    engine.close()
    return {"saved": saved, "after": after, "losses": losses}


@pytest.mark.parametrize("moments", ["bf16", "8bit"])
def test_a_checkpoint_with_per_parameter_counts_resumes_in_another_moment_format(tmp_path, moments):
    """bf16 and 8-bit moments step whole flats (their rounding runs along the shard): the saved per-parameter
    counts give way to the flat's. Stepping runs of an 8-bit shard raised for want of its scales."""
    cfg = _experts_config("cpu", str(tmp_path))
    result = _resume_in_format(cfg, str(tmp_path / "ckpt"), moments)
    assert result["saved"]  # the fp32 run skipped some parameters' steps
    assert all(counts is None for counts in result["after"])
    assert all(math.isfinite(v) for v in result["losses"])


@pytest.mark.parametrize("offload,zero", [("none", {}), ("none", {"stage": 2}), ("cpu", {}), ("nvme", BUDGET)])
def test_ranks_reduce_blocks_in_one_order_when_their_rows_reach_different_experts(tmp_path, offload, zero):
    """A block's gradients go when backward has its input gradients (`scheduler.input_grads`), on every rank
    alike: counting its parameters' gradients finished on rank 0 in backward and on rank 1 only at its end, so
    the ranks summed different blocks' gradients (same shapes: no error) or, stepping in backward, hung."""
    cfg = _experts_config(offload, str(tmp_path), clip=0.0, grad_accum=2, **zero)
    cfg["train_micro_batch_size_per_gpu"] = 4
    results = run_distributed(_train_plan, 2, cfg, UNEVEN, timeout_s=60)
    assert_weights_close(results[0]["state"], _plain_plan(UNEVEN))


# One micro-batch a step; expert 2 gets no row in step 2 (a flat of its own: no step owed), then rows again.
EXPERT_2_RESTS = [[(experts, False, False)] for experts in ([0, 1, 2, 0], [0, 1, 2, 1], [0, 0, 1, 1], [0, 1, 2, 2],
                                                             [2, 1, 2, 0], [2, 2, 1, 0])]  # fmt: skip


def test_a_replayed_block_hands_over_no_gradient_for_a_flat_whose_step_was_not_owed(tmp_path):
    """Clipped NVMe steps under a host budget recompute each block's gradients in the next forward. A flat of
    the block that got no gradient is owed no step; its recomputed gradient used to be kept as the next step's."""
    cfg = _experts_config("nvme", str(tmp_path), clip=1.0, sub_group_size=600, **BUDGET)
    results = run_distributed(_train_plan, 2, cfg, EXPERT_2_RESTS)
    assert results[0]["replayed"] > 0
    assert_weights_close(results[0]["state"], _plain_plan(EXPERT_2_RESTS, clip=1.0))
