"""The NVMe optimizer's step under gradient clipping, deferred into the next forward.

With clipping the step needs the global gradient norm, known only after backward, so it cannot run as
each gradient arrives. Instead each shard is owed its step (with the clip coefficient and the
hyper-parameters of that moment) and stepped just before the next forward gathers it, its state's I/O
overlapping that forward. Whoever reads a shard first (a checkpoint, full weights, a gather) settles
what is owed to it. The result is exactly the clipped step: plain PyTorch with clip_grad_norm_.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter

import pytest
import torch
from dist import run_distributed
from harness import assert_weights_close, config, mean_losses, reference_for, train_on_rank, train_steps
from toy_models import batches, make_model

import infinity
from infinity.shards import ShardKind

STEPS = 4
MICRO_BS = 2


def _config(offload_param: str, dtype: str, grad_accum: int, nvme_path: str) -> dict:
    return config(
        micro_bs=MICRO_BS,
        persistence=64,
        grad_accum=grad_accum,
        offload_param=offload_param,
        offload_optimizer="nvme",
        dtype=dtype,
        clip=1.0,
        nvme_path=nvme_path,
    )


def _nvme_reads(engine) -> list[tuple[str, str]]:
    """A list that receives the key of every read from NVMe from now on (the engine still counts each move)."""
    reads: list[tuple[str, str]] = []
    count = engine.moves.record

    def record(event) -> None:
        if event.src == "nvme":
            reads.append(event.key)
        count(event)

    engine.moves.record = record
    return reads


def _wait_until_in_host(store, keys: set, timeout_s: float = 30) -> None:
    """Wait for reads started without waiting (the stepper's read-ahead) to land these keys in host memory."""
    deadline = time.monotonic() + timeout_s
    while not all("host" in store.tiers.tiers_holding(k) for k in keys) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize(
    "world,offload_param,dtype,grad_accum",
    [*itertools.product([1, 2], ["nvme", "none"], ["fp32"], [1, 2]), (1, "nvme", "bf16", 1), (2, "nvme", "bf16", 2)],
)
def test_deferred_clipped_steps_match_plain_pytorch(tmp_path, world, offload_param, dtype, grad_accum):
    cfg = _config(offload_param, dtype, grad_accum, str(tmp_path))
    results = run_distributed(train_on_rank, world, "gpt", cfg, STEPS, MICRO_BS, timeout_s=120)
    ref_losses, ref_state, _ = reference_for(
        "gpt",
        STEPS,
        MICRO_BS * world,
        grad_accum=grad_accum,
        dtype=torch.bfloat16 if dtype == "bf16" else torch.float32,
    )
    assert mean_losses(results) == pytest.approx(ref_losses, rel=1e-5 if dtype == "fp32" else 2e-2)
    assert_weights_close(results[0]["state"], ref_state, dtype)
    # the steps did run in the following forwards (the last one when the weights were read), resident
    # parameters (one rank, offload_param none) just before their block's forward
    for r in results:
        assert r["stepped_when_needed"] > 0 and r["stepped_in_backward"] == 0


def test_reading_weights_or_saving_right_after_a_step_settles_what_is_owed(tmp_path):
    """Right after step() the shards are owed their step: full_state_dict, a checkpoint and GatheredParameters
    see the stepped weights, and a run resumed from that checkpoint continues exactly."""
    cfg = _config("nvme", "fp32", 1, str(tmp_path))
    ref_losses, ref_state, _ = reference_for("gpt", STEPS, MICRO_BS)
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    data = batches("gpt", MICRO_BS)
    losses = train_steps(engine, data, 2)
    shards = len(engine.shards.records)
    assert engine.optimizer.stepped_when_needed == shards  # the first step, in the second forward; the second owed
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert engine.optimizer.stepped_when_needed == 2 * shards  # the save read the shards: it settled them first
    _, mid_state, _ = reference_for("gpt", 2, MICRO_BS)
    assert_weights_close(engine.full_state_dict(), mid_state)
    losses += train_steps(engine, data, 2)
    engine.close()
    assert losses == pytest.approx(ref_losses, rel=1e-5)

    resumed, _, _, _ = infinity.initialize(model=make_model("gpt", seed=5), config=cfg)
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    data = batches("gpt", MICRO_BS)
    for _ in range(2):
        next(data)
    assert train_steps(resumed, data, 2) == pytest.approx(ref_losses[2:], rel=1e-5)
    assert_weights_close(resumed.full_state_dict(), ref_state)
    resumed.close()


def test_a_deferred_step_uses_the_learning_rate_of_its_own_step(tmp_path):
    """The LR schedule moves on right after step(); the owed step, taken in the next forward, must use the
    rate that was current at step() (a halving schedule against plain PyTorch's)."""
    cfg = _config("nvme", "fp32", 1, str(tmp_path))

    def halve(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)

    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg, lr_scheduler=halve)
    losses = train_steps(engine, batches("gpt", MICRO_BS), STEPS)
    state = engine.full_state_dict()
    engine.close()

    model = make_model("gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["optimizer"]["params"]["lr"], weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    ref_losses, data = [], batches("gpt", MICRO_BS)
    for _ in range(STEPS):
        x, y = next(data)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        ref_losses.append(loss.item())
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_weights_close(state, {k: v.detach() for k, v in model.state_dict().items()})


@pytest.mark.parametrize("stage", [2, 3])
def test_resident_parameters_of_one_rank_step_before_their_block_and_wait_for_weights_settles_them(tmp_path, stage):
    """One rank with its parameters in memory (never gathered) and the optimizer on NVMe: the clipped step is
    owed until the next forward reaches each block; `wait_for_weights()` settles it, so iterating
    `model.parameters()` then sees plain PyTorch's clipped weights."""
    cfg = _config("none", "fp32", 1, str(tmp_path))
    cfg["zero_optimization"]["stage"] = stage
    model = make_model("gpt")
    engine, _, _, _ = infinity.initialize(model=model, config=cfg)
    losses = train_steps(engine, batches("gpt", MICRO_BS), STEPS)
    shards = len(engine.shards.records)
    assert engine.optimizer.stepped_when_needed == (STEPS - 1) * shards  # the last step is still owed
    engine.wait_for_weights()
    assert engine.optimizer.stepped_when_needed == STEPS * shards
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine.close()
    ref_losses, ref_state, _ = reference_for("gpt", STEPS, MICRO_BS)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_weights_close(state, {k: ref_state[k] for k in state})


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_state_a_deferred_step_takes_first_is_read_during_backward_and_once(tmp_path, dtype):
    """The stepper's window is idle while backward runs before a deferred step: the master and moments of the
    shards the step takes first are read then (not in the next forward), and the step uses those copies, so
    no state is read twice. The steps still match plain PyTorch's clipped ones."""
    cfg = _config("none", dtype, 1, str(tmp_path))  # one rank, parameters in memory, optimizer on NVMe
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    store = engine.shards
    reads = _nvme_reads(engine)
    data = batches("gpt", MICRO_BS)
    losses = train_steps(engine, data, 1)  # the first deferred step: its order is the one expected next
    first = next(iter(store.records))  # the embedding: first in forward, its gradient last in backward
    state_keys = {store.key(first, ShardKind.MASTER), store.key(first, ShardKind.MOMENTS)}
    for _ in range(STEPS - 1):
        x, y = next(data)
        _, loss = engine(x, y)  # settles the step owed since the last step()
        reads.clear()
        engine.backward(loss)
        _wait_until_in_host(store, state_keys)
        assert state_keys <= set(reads)  # read during backward ...
        engine.step()
        engine.wait_for_weights()  # ... and the step, settled here, reads no state twice
        losses.append(loss.item())
        state_reads = Counter(k for k in reads if k[1] in (ShardKind.MASTER.value, ShardKind.MOMENTS.value))
        assert len(state_reads) == 2 * len(store.records) and max(state_reads.values()) == 1, state_reads
    assert engine.optimizer.stepped_when_needed == STEPS * len(store.records)
    state = engine.full_state_dict()
    engine.close()
    ref_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    ref_losses, ref_state, _ = reference_for("gpt", STEPS, MICRO_BS, dtype=ref_dtype)
    assert losses == pytest.approx(ref_losses, rel=1e-5 if dtype == "fp32" else 2e-2)
    assert_weights_close(state, ref_state, dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_with_spare_host_memory_the_whole_deferred_step_reads_its_state_during_backward(tmp_path, dtype):
    """No host budget and memory to spare: the deferred step's window grows to every shard
    (`memory_plan.deferred_step_window`), so backward reads all the state the step will take (the next forward
    only writes it back), each key once. The steps still match plain PyTorch's clipped ones."""
    cfg = _config("none", dtype, 1, str(tmp_path))  # one rank, parameters in memory, optimizer on NVMe
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 2
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    store = engine.shards
    assert engine.optimizer.stepper.window == len(store.records) > 2
    assert not store.placement.master_is_param  # the fp32 master lives beside its moments, on NVMe
    kinds = (ShardKind.MASTER, ShardKind.MOMENTS)
    state_keys = {store.key(flat, kind) for flat in store.records for kind in kinds}
    reads = _nvme_reads(engine)
    data = batches("gpt", MICRO_BS)
    losses = train_steps(engine, data, 1)
    for _ in range(STEPS - 1):
        x, y = next(data)
        _, loss = engine(x, y)
        reads.clear()
        engine.backward(loss)
        _wait_until_in_host(store, state_keys)
        assert set(reads) == state_keys  # all of it during backward, before step() is called
        engine.step()
        engine.wait_for_weights()
        assert Counter(reads) == dict.fromkeys(state_keys, 1)  # and the step read nothing again
        losses.append(loss.item())
    state = engine.full_state_dict()
    engine.close()
    ref_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    ref_losses, ref_state, _ = reference_for("gpt", STEPS, MICRO_BS, dtype=ref_dtype)
    assert losses == pytest.approx(ref_losses, rel=1e-5 if dtype == "fp32" else 2e-2)
    assert_weights_close(state, ref_state, dtype)


def test_the_forward_does_not_wait_for_the_writes_of_the_step_it_settles(tmp_path):
    """Each shard stepped in the forward is written back behind it, and those writes may queue behind the
    reads of later blocks' shards on the one disk: past what the window bounds (it waits for the oldest write
    once the window is full), the forward does not wait for them. Here no write after the first shard's can
    finish until the forward is over (the store finishes moves in order, behind a job that waits); the next
    step waits for them, and the run is still plain PyTorch's."""
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=_config("nvme", "fp32", 1, str(tmp_path)))
    data = batches("gpt", MICRO_BS)
    losses = train_steps(engine, data, 1)
    assert engine.optimizer.stepper.window == len(engine.shards.records)  # spare memory: the whole step
    gate = threading.Event()
    give_back = engine.shards.give_back

    def give_back_then_gate(*args, **kwargs):  # the first shard's writes go ahead of the gate, the rest behind
        returned = give_back(*args, **kwargs)
        if engine.shards.give_back is give_back_then_gate:
            engine.tiers._completer.submit(gate.wait)
            engine.shards.give_back = give_back
        return returned

    engine.shards.give_back = give_back_then_gate
    x, y = next(data)
    out = []
    forward = threading.Thread(target=lambda: out.append(engine(x, y)))
    forward.start()
    forward.join(30)
    try:
        assert out, "the forward waited for the settled step's writes"
        assert engine.optimizer.stepped_when_needed == len(engine.shards.records)
        assert engine.optimizer.stepper._behind  # its last writes, still in flight
    finally:
        gate.set()
        forward.join()
    loss = out[0][1]
    engine.backward(loss)
    engine.step()
    losses += [loss.item(), *train_steps(engine, data, STEPS - 2)]
    engine.wait_for_weights()
    state = engine.full_state_dict()
    engine.close()
    ref_losses, ref_state, _ = reference_for("gpt", STEPS, MICRO_BS)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_weights_close(state, ref_state)


def test_a_deferred_step_reads_the_next_shards_ahead_while_it_writes_the_last_ones_back(tmp_path):
    """Under a host budget the window stays `buffer_count` shards (4), shared by the state read ahead and the
    stepped shards being written back. Half of it stays for reads: when a shard of the deferred step is lent,
    the read of the shard after it has been started already (with the window full of writes it was started
    only once the shard before was stepped, and read one at a time). The steps still match plain PyTorch."""
    cfg = _config("nvme", "fp32", 1, str(tmp_path))
    cfg["zero_optimization"]["host_budget_bytes"] = 256 << 20
    cfg["zero_optimization"]["sub_group_size"] = 4096  # flats of 4096 elements at most: more shards than the window
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    store, stepper = engine.shards, engine.optimizer.stepper
    assert stepper.window == 4 < len(store.records)
    requested: set = set()
    ahead_at_lend: list[bool] = []
    prefetch_state, lend = store.prefetch_state, store.lend

    def record_prefetch(flats, with_grad, master=True):
        flats = list(flats)
        if with_grad:  # the deferred step's read-ahead (backward's reads of the first shards are not)
            requested.update(flats)
        return prefetch_state(flats, with_grad, master)

    def record_lend(flat, with_grad, gather_next=False):
        if gather_next and stepper._deferred:  # a deferred shard with another after it
            ahead_at_lend.append(stepper._deferred[0] in requested)
        return lend(flat, with_grad, gather_next)

    defer = stepper.defer

    def record_defer(*args, **kwargs):  # each step's read-ahead counts from its own start
        requested.clear()
        return defer(*args, **kwargs)

    store.prefetch_state, store.lend, stepper.defer = record_prefetch, record_lend, record_defer
    data = batches("gpt", MICRO_BS)
    losses = train_steps(engine, data, STEPS)
    engine.wait_for_weights()
    assert len(ahead_at_lend) >= (STEPS - 1) * (len(store.records) - 1)
    assert all(ahead_at_lend), ahead_at_lend
    state = engine.full_state_dict()
    engine.close()
    ref_losses, ref_state, _ = reference_for("gpt", STEPS, MICRO_BS)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_weights_close(state, ref_state)
