"""Device discipline on a CPU-only machine: collectives refuse tensors off the group's device, the engine moves
CPU inputs to its device and refuses others, each rank binds the GPU its LOCAL_RANK names.

Without a GPU, "the other side of the bus" is played by devices torch can name without one: a group whose
collectives take `cuda:0` tensors handed a CPU tensor (the NCCL failure of a CPU tensor), meta tensors.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
import torch.distributed as dist
from device_check import DeviceMixCheck
from dist import run_distributed
from harness import config
from toy_models import batches, make_model

import infinity
from infinity.cli.train import _mean_over_ranks
from infinity.comm import CommDeviceError, CommGroup, comm_device
from infinity.comm.process_group import device_index
from infinity.engine.inputs import move_inputs

CUDA0 = torch.device("cuda", 0)
cpu_compute = pytest.mark.skipif(torch.cuda.is_available(), reason="the engine computes on the GPU where there is one")

# -- collectives -------------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "call",
    [
        lambda c, t: c.all_reduce(t, "loss for the progress display"),
        lambda c, t: c.broadcast(t, 0, "loss for the progress display"),
        lambda c, t: c.all_gather(t.clone(), t, "loss for the progress display"),
        lambda c, t: c.reduce_scatter_sum(t.clone(), t, "loss for the progress display"),
    ],
    ids=["all_reduce", "broadcast", "all_gather", "reduce_scatter"],
)
def test_a_host_tensor_in_a_gpu_groups_collective_is_refused_naming_it(call):
    """One rank too: the check comes before any collective (or local copy) runs."""
    comm = CommGroup(0, 1, None, device=CUDA0)
    with pytest.raises(CommDeviceError, match=r"of loss for the progress display: its \w+ tensor is on cpu.*cuda:0"):
        call(comm, torch.zeros(4, dtype=torch.float64))


@pytest.mark.unit
def test_a_tensor_off_a_cpu_groups_device_is_refused_naming_it():
    comm = CommGroup(0, 1)
    with pytest.raises(CommDeviceError, match=r"all-gather of parameters of b0#0: its input tensor is on meta"):
        comm.all_gather(torch.empty(8), torch.empty(8, device="meta"), "parameters of b0#0")


def _misplaced_all_reduce() -> str:
    comm = CommGroup(dist.get_rank(), 2, dist.group.WORLD, device=comm_device(torch.device("cpu"), dist.group.WORLD))
    ok = comm.all_reduce(torch.ones(2), "a well placed tensor")
    assert torch.equal(ok, torch.full((2,), 2.0))
    try:
        comm.all_reduce(torch.ones(2, device="meta"), "gradient norm")
    except CommDeviceError as exc:
        return str(exc)
    return "no error"


def test_every_rank_refuses_a_misplaced_tensor_before_the_collective():
    """Over a real Gloo group: the refusal comes on every rank before any byte is sent, so nothing hangs."""
    messages = run_distributed(_misplaced_all_reduce, 2, timeout_s=60)
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}/2: all-reduce of gradient norm: its buffer tensor is on meta")


def _gloo_group_for_a_gpu_rank() -> str:
    try:
        comm_device(CUDA0, dist.group.WORLD)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_gloo_group_for_a_rank_computing_on_a_gpu_is_refused():
    messages = run_distributed(_gloo_group_for_a_gpu_rank, 2, timeout_s=60)
    assert all("backend is 'gloo' but this rank computes on cuda:0" in m and "'nccl'" in m for m in messages)


def _train_loss_mean(value: float) -> tuple[float, str]:
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=config("mlp"))
    try:
        return _mean_over_ranks(engine, value + engine.comm.rank), str(engine.comm.device)
    finally:
        engine.close()


@cpu_compute
def test_the_train_commands_loss_mean_runs_on_the_groups_device():
    results = run_distributed(_train_loss_mean, 2, 1.5, timeout_s=60)
    assert results == [(2.0, "cpu"), (2.0, "cpu")]  # (1.5 + 2.5) / 2 on each rank


# -- inputs ------------------------------------------------------------------------------------------------

Batch = namedtuple("Batch", ["tokens", "mask"])


@pytest.mark.unit
def test_cpu_inputs_move_to_the_device_wherever_they_are_nested():
    meta = torch.device("meta")  # a device torch can name without a GPU
    x, y, mask = torch.randn(2, 3), torch.arange(4), torch.ones(2, dtype=torch.bool)
    args, kwargs = move_inputs(
        (x, [y, (mask, 7)]), {"batch": Batch(y, mask), "extra": {"labels": y, "name": "n"}, "scale": 0.5}, meta
    )
    batch, labels = kwargs["batch"], kwargs["extra"]["labels"]
    moved = [args[0], args[1][0], args[1][1][0], batch.tokens, batch.mask, labels]
    assert all(t.device == meta for t in moved)
    assert [t.dtype for t in moved] == [x.dtype, y.dtype, mask.dtype, y.dtype, mask.dtype, y.dtype]  # dtypes kept
    assert isinstance(args[1], list) and isinstance(args[1][1], tuple) and isinstance(kwargs["batch"], Batch)
    assert args[1][1][1] == 7 and kwargs["extra"]["name"] == "n" and kwargs["scale"] == 0.5


@pytest.mark.unit
def test_inputs_already_on_the_device_are_passed_as_they_are():
    x = torch.randn(3)
    args, kwargs = move_inputs((x,), {"y": x}, torch.device("cpu"))
    assert args[0] is x and kwargs["y"] is x


@pytest.mark.unit
@pytest.mark.parametrize(
    "args,kwargs,where",
    [
        ((torch.empty(2, device="meta"),), {}, r"args\[0\]"),
        ((), {"targets": torch.empty(2, device="meta")}, r"kwargs\['targets'\]"),
        ((), {"batch": [torch.zeros(2), torch.empty(2, device="meta")]}, r"kwargs\['batch'\]\[1\]"),
    ],
)
def test_an_input_on_another_device_is_refused_naming_it(args, kwargs, where):
    with pytest.raises(ValueError, match=rf"forward input {where} is on meta, but this rank computes on cpu"):
        move_inputs(args, kwargs, torch.device("cpu"))


@cpu_compute
def test_the_engine_refuses_an_input_on_another_device_before_running_the_model():
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=config("mlp"))
    try:
        with pytest.raises(ValueError, match=r"forward input args\[1\] is on meta"):
            engine(torch.randn(2, 16), torch.empty(2, 8, device="meta"))
        x, y = torch.randn(2, 16), torch.randn(2, 8)
        _, loss = engine(x, y)  # and it still trains after the refusal
        engine.backward(loss)
        engine.step()
    finally:
        engine.close()


# -- the rank's GPU ----------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    "current,local_rank,count,expected",
    [
        (0, None, 4, 0),  # no launcher
        (0, "3", 4, 3),  # torchrun: one GPU per local rank
        (2, "3", 4, 2),  # the user bound a device already: it stays
        (0, "3", 1, 0),  # each process sees only its own GPU (CUDA_VISIBLE_DEVICES per rank)
    ],
)
def test_each_rank_binds_the_gpu_its_local_rank_names(current, local_rank, count, expected):
    assert device_index(current, local_rank, count) == expected


@pytest.mark.unit
def test_more_local_ranks_than_gpus_is_refused_with_the_fix():
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=4 but this process sees 2 GPUs.*--nproc_per_node"):
        device_index(0, "4", 2)


@cpu_compute
def test_a_cpu_only_machine_computes_and_communicates_on_the_cpu():
    assert comm_device(torch.device("cpu"), None) == torch.device("cpu")
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=config("mlp"))
    try:
        assert engine.device == engine.comm.device == torch.device("cpu")
    finally:
        engine.close()


# -- the step's ops ----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_device_mix_check_flags_mixed_ops_and_lets_copies_and_scalars_pass():
    """The checker `test_gpu` runs training under, checked on ops a CPU-only machine can dispatch."""
    meta = torch.device("meta")
    with DeviceMixCheck(torch.device("cpu")) as check:
        a = torch.ones(3)
        _ = a * torch.tensor(2.0)  # a 0-dim CPU tensor: a scalar to any kernel
        _ = a.to(meta)  # a copy between devices: what moves bytes
        with pytest.raises(RuntimeError):
            _ = a + torch.ones(3, device=meta)  # torch refuses it too, after the check saw it
        _ = torch.ones(3, device=meta, requires_grad=True) * 2  # a tensor requiring grad off the compute device
    assert len(check.violations) == 2, check.violations
    assert "mixes devices ['cpu', 'meta']" in check.violations[0]
    assert "requiring grad on meta, not cpu" in check.violations[1]


@cpu_compute
def test_training_with_the_device_apart_passes_the_device_mix_check():
    cfg = config(
        micro_bs=2, persistence=64, grad_accum=2, offload_param="cpu", offload_optimizer="cpu", dtype="bf16",
        extra_zero={"device_budget_bytes": 64 << 20},
    )  # fmt: skip
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    data = batches("gpt", 2)
    try:
        with DeviceMixCheck(engine.device) as check:
            for _ in range(4):
                x, y = next(data)
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
    finally:
        engine.close()
    assert check.ops > 1000 and check.violations == []
