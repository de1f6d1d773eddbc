"""The multi-process harness: real Gloo ranks, results back in rank order, failures and hangs reported."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from dist import RankError, run_distributed
from harness import WEIGHT_DECAY, assert_weights_close, reference_train

from infinity.data import ByteBatches, load_corpus
from infinity.models import GPT, gpt_preset

# Rank functions live at module level: the harness pickles them by reference.


def _all_reduce_sum(base: float, *, scale: float) -> list[float]:
    t = torch.tensor([base + dist.get_rank()]) * scale
    dist.all_reduce(t)
    return t.tolist()


def _environment() -> dict[str, str]:
    return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}


def _init_from_environment() -> int:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item()) + torch.get_num_threads() * 100


def _rank1_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 would wait here forever: the harness must not


def _rank1_dies() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _rank1_hangs() -> None:
    if dist.get_rank() == 1:
        time.sleep(60)


def test_all_reduce_across_two_ranks_returns_results_in_rank_order():
    assert run_distributed(_all_reduce_sum, 2, 1.0, scale=2.0) == [[6.0], [6.0]]


def test_each_rank_sees_torchrun_style_environment():
    envs = run_distributed(_environment, 2)
    assert [e["RANK"] for e in envs] == ["0", "1"] and [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"} and {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}


def test_code_under_test_can_init_the_process_group_itself_with_one_thread_per_rank():
    assert run_distributed(_init_from_environment, 2, init_process_group=False) == [102, 102]


def test_a_raising_rank_is_reraised_naming_the_rank_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 raised ValueError: boom on purpose") as info:
        run_distributed(_rank1_raises, 2, timeout_s=60)
    assert info.value.rank == 1 and isinstance(info.value.exception, ValueError)
    assert "_rank1_raises" in str(info.value)  # the rank's own traceback
    assert time.monotonic() - start < 30


def test_a_rank_that_dies_is_reported_with_its_exit_code():
    with pytest.raises(RankError, match="rank 1 exited with code 3"):
        run_distributed(_rank1_dies, 2, timeout_s=60)


def test_a_hanging_rank_is_killed_with_a_clear_timeout_error():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after 2s; ranks \[1\] were still running"):
        run_distributed(_rank1_hangs, 2, timeout_s=2)
    assert time.monotonic() - start < 15


# The correctness contract end to end: data-parallel ranks on their ByteBatches slices, gradients averaged,
# equal the single-process reference on the global batch.

CFG = gpt_preset("tiny")
STEPS, MICRO, ACCUM, LR = 3, 2, 2, 1e-3


def _tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def _data_parallel_adamw() -> tuple[list[float], dict[str, torch.Tensor]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    batches = ByteBatches(load_corpus(), MICRO, CFG.block_size, seed=1, rank=rank, world_size=world)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        step_loss = torch.zeros(1)
        for _ in range(ACCUM):
            _, loss = model(*next(batches))
            (loss / ACCUM).backward()
            step_loss += loss.detach() / ACCUM
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
        opt.step()
    return losses, model.state_dict()


def test_data_parallel_ranks_match_the_single_process_reference():
    ranks = run_distributed(_data_parallel_adamw, 2)
    batches = ByteBatches(load_corpus(), 2 * MICRO, CFG.block_size, seed=1)
    ref_losses, ref_state, _ = reference_train(
        _tiny_gpt, batches, STEPS, lr=LR, weight_decay=WEIGHT_DECAY, clip=0.0, grad_accum=ACCUM
    )
    # Not bitwise (the batch mean is reduced in another order): the harness's fp32 tolerances, tight enough that
    # a weight decay differing between the two sides fails.
    for losses, state in ranks:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert_weights_close(state, ref_state)
