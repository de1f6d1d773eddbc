"""ZeRO stages 1 and 2 against plain PyTorch, and checkpoints moving between stages.

Stages 1 and 2 keep the parameters replicated and resident on every rank and partition the
optimizer state (and, at stage 2, the gradients); after each step the updated partitions are
all-gathered back into every rank's parameters. Tolerances are the engine matrix's
(`test_engine_correctness`): both stages reduce every micro-batch, so they sum in plain PyTorch's order.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from dist import run_distributed
from harness import (
    assert_matches_plain_pytorch,
    assert_weights_close,
    config,
    mean_losses,
    reference_for,
    train_on_rank,
    train_steps,
)
from toy_models import batches, make_model

import infinity
from infinity.config import ConfigError, load_config, no_effect_notices

STEPS = 4
MICRO_BS = 2


def _stage_config(stage: int, optim: str, dtype: str, grad_accum: int, nvme_path: str, **extra) -> dict:
    return config(
        micro_bs=MICRO_BS,
        persistence=64,
        grad_accum=grad_accum,
        offload_optimizer=optim,
        dtype=dtype,
        clip=1.0,
        nvme_path=nvme_path,
        extra_zero={"stage": stage, **extra},
    )


MATRIX = [
    *itertools.product([1, 2], [2], ["none", "cpu", "nvme"], ["fp32", "bf16"], [1, 2]),
    *itertools.product([1, 2], [1], ["none", "cpu", "nvme"], ["fp32", "bf16"], [2]),
]


@pytest.mark.parametrize("stage,world,optim,dtype,grad_accum", MATRIX)
def test_stage_matches_plain_pytorch(tmp_path, stage, world, optim, dtype, grad_accum):
    cfg = _stage_config(stage, optim, dtype, grad_accum, str(tmp_path))
    results = run_distributed(train_on_rank, world, "gpt", cfg, STEPS, MICRO_BS, timeout_s=120)
    assert_matches_plain_pytorch(results, "gpt", STEPS, MICRO_BS, grad_accum=grad_accum, dtype=dtype)
    assert not list(tmp_path.iterdir()), "the swap files are removed at shutdown"


def resident_probe(stage: int) -> dict:
    """Stages 1-2 on two ranks: every block is resident (nothing prefetched: only the updated partitions are
    all-gathered, after each step)."""
    cfg = _stage_config(stage, "cpu", "fp32", 1, "/unused")
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    data = batches("gpt", MICRO_BS, rank=engine.comm.rank, world_size=2)
    train_steps(engine, data, 2)
    out = {
        "resident": [b.resident for b in (*engine.blocks, engine.root)],
        "prefetches": engine.scheduler.prefetches_issued,
    }
    engine.close()
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_stages_one_and_two_keep_parameters_resident_on_every_rank(stage):
    for r in run_distributed(resident_probe, 2, stage):
        assert all(r["resident"]) and r["prefetches"] == 0


def read_between_steps(stage: int, how: str) -> dict:
    """Train STEPS steps on this rank, then read the weights without another forward: the updated
    partitions are still arriving in the background when step() returns."""
    model = make_model("gpt")
    cfg = _stage_config(stage, "cpu", "fp32", 1, "/unused")
    engine, _, _, _ = infinity.initialize(model=model, config=cfg)
    data = batches("gpt", MICRO_BS, rank=engine.comm.rank, world_size=2)
    train_steps(engine, data, STEPS)
    if how == "state_dict":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    elif how == "parameters":  # iterating parameters() reports no read: the caller waits first
        engine.wait_for_weights()
        state = {name: p.detach().clone() for name, p in model.named_parameters()}
    elif how == "attribute":  # each weight read by name, as user code reads `model.lm_head.weight`
        state = {}
        for name in dict(model.named_parameters()):
            owner, _, attr = name.rpartition(".")
            state[name] = getattr(model.get_submodule(owner), attr).detach().clone()
    engine.close()
    if how == "after_close":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"state": state, "rank": engine.comm.rank}


@pytest.mark.parametrize("how", ["state_dict", "attribute", "parameters", "after_close"])
def test_weights_read_right_after_a_step_are_the_updated_ones(how):
    """Stage 2 on two ranks, each rank stepped half of every flat: a read between steps waits for the other
    half (model.state_dict(), a parameter read by attribute, engine.wait_for_weights(), anything after
    engine.close())."""
    ref = reference_for("gpt", STEPS, 2 * MICRO_BS)
    for r in run_distributed(read_between_steps, 2, 2, how):
        state = {k: r["state"][k] for k in ref.state if k in r["state"]}
        assert list(state) == [k for k in ref.state if k in state] and len(state) >= len(ref.state) - 1
        assert_weights_close(state, {k: ref.state[k] for k in state})


def test_offloading_parameters_below_stage_three_is_refused_with_the_fix():
    cfg = config(micro_bs=MICRO_BS, offload_param="cpu", offload_optimizer="cpu", extra_zero={"stage": 2})
    with pytest.raises(ConfigError, match=r"offload_param.device' is 'cpu' with stage 2.*set the stage to 3"):
        infinity.initialize(model=make_model("gpt"), config=cfg)


def test_stage_zero_is_refused_naming_ddp():
    cfg = config(micro_bs=MICRO_BS, extra_zero={"stage": 0})
    with pytest.raises(ConfigError, match="stage' is 0.*DistributedDataParallel"):
        infinity.initialize(model=make_model("gpt"), config=cfg)


# -- checkpoints between stages --------------------------------------------------------------------------


def train_and_save(save_dir: str, stage: int, steps: int) -> dict:
    """Train `steps` steps at `stage` with a global batch of 4 rows, save; return the full weights."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _stage_config(stage, "cpu", "fp32", 1, "/unused", elastic_checkpoint=True)
    cfg["train_micro_batch_size_per_gpu"] = 4 // world
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    data = batches("gpt", 4 // world, rank=rank, world_size=world)
    losses = train_steps(engine, data, steps)
    engine.save_checkpoint(save_dir, client_state={"step": steps})
    full = engine.full_state_dict()
    engine.close()
    return {"full": full, "losses": losses}


def load_and_train(save_dir: str, stage: int, steps: int) -> dict:
    """A fresh engine (another seed) at `stage` loads the checkpoint and trains `steps` more."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _stage_config(stage, "cpu", "fp32", 1, "/unused", elastic_checkpoint=True)
    cfg["train_micro_batch_size_per_gpu"] = 4 // world
    engine, _, _, _ = infinity.initialize(model=make_model("gpt", seed=9), config=cfg)
    _, client = engine.load_checkpoint(save_dir)
    loaded = engine.full_state_dict()
    data = batches("gpt", 4 // world, rank=rank, world_size=world)
    for _ in range(client["step"]):
        next(data)
    losses = train_steps(engine, data, steps)
    out = {"loaded": loaded, "losses": losses, "state": engine.full_state_dict(), "steps": engine.global_steps}
    engine.close()
    return out


@pytest.mark.parametrize("saved,loaded", [((2, 2), (3, 1)), ((3, 1), (2, 2))])
def test_a_checkpoint_saved_at_one_stage_loads_at_another(tmp_path, saved, loaded):
    (stage_a, world_a), (stage_b, world_b) = saved, loaded
    before = run_distributed(train_and_save, world_a, str(tmp_path), stage_a, 2)
    after = run_distributed(load_and_train, world_b, str(tmp_path), stage_b, 2)
    ref_losses, ref_state, _ = reference_for("gpt", 4, 4)
    for r in after:
        assert r["steps"] == 4
        assert all(torch.equal(r["loaded"][k], v) for k, v in before[0]["full"].items())
    # the per-rank losses are of each rank's rows: the global loss of a step is their mean
    assert mean_losses(before) + mean_losses(after) == pytest.approx(ref_losses, rel=1e-5)
    assert_weights_close(after[0]["state"], ref_state)


# -- a stage-2 config as DeepSpeed documents it ------------------------------------------------------------

ZERO2_CPU_OFFLOAD = {  # the zero_optimization section of DeepSpeed's ZeRO-2 + CPU offload example
    "stage": 2,
    "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "allgather_partitions": True,
    "allgather_bucket_size": 2e8,
    "overlap_comm": True,
    "reduce_scatter": True,
    "reduce_bucket_size": 2e8,
    "contiguous_gradients": True,
}


def zero2_notices_and_training(cfg: dict) -> dict:
    out = train_on_rank("gpt", cfg, STEPS, MICRO_BS)
    out["notices"] = no_effect_notices(load_config(cfg), cuda=False)
    return out


def test_deepspeeds_documented_stage_2_offload_config_runs_unchanged_and_trains_like_plain_pytorch():
    """Its keys take effect (the buckets, overlap_comm) or are at the value infinity always behaves as
    (allgather_partitions, reduce_scatter, contiguous_gradients); the one key without an effect on a machine
    without a GPU, pin_memory, is named at start."""
    cfg = config(micro_bs=MICRO_BS, clip=1.0)
    cfg["zero_optimization"] = dict(ZERO2_CPU_OFFLOAD)
    results = run_distributed(zero2_notices_and_training, 2, cfg, timeout_s=120)
    assert_matches_plain_pytorch(results, "gpt", STEPS, MICRO_BS)
    notices = results[0]["notices"]
    assert len(notices) == 1 and "offload_optimizer.pin_memory" in notices[0] and "no effect" in notices[0]
