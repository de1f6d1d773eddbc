"""The placement policy as a table: config x machine x world size -> where each byte lives and how it moves.

Each row states the expected decision outright (the table is the reference); a sweep over every
combination then checks the invariants that tie the fields together.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from infinity.config import load_config, resolve_auto, resolve_batch_sizes
from infinity.shards import MallocTuning, StepperKind, resolve_placement
from infinity.storage import Tier

pytestmark = pytest.mark.unit

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)
D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME


def _config(param: str, optim: str, dtype: str = "fp32", clip: float = 1.0, host_budget=None, device_budget=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": clip,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": param, "nvme_path": "/tmp"},
            "offload_optimizer": {"device": optim, "nvme_path": "/tmp"},
            "host_budget_bytes": host_budget,
            "device_budget_bytes": device_budget,
        },
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True}
    return resolve_auto(resolve_batch_sizes(load_config(cfg), 1), 64)


# (param, optim, dtype, clip, device, world, client) -> (param_home, gather_from, optim_home, resident,
#                                                        master_is_param, stepper, step_in_backward)
TABLE = [
    # one rank, CPU-only: in-memory shards are the parameters themselves
    (("none", "none", "fp32", 1.0, CPU, 1, False), (D, D, D, True, True, StepperKind.TORCH, False)),
    (("cpu", "cpu", "fp32", 1.0, CPU, 1, False), (H, H, H, True, True, StepperKind.NATIVE, False)),
    (("cpu", "cpu", "bf16", 1.0, CPU, 1, False), (H, H, H, True, False, StepperKind.NATIVE, False)),
    (("none", "cpu", "fp32", 1.0, CPU, 1, False), (D, D, H, True, True, StepperKind.NATIVE, False)),
    # NVMe: gathers read host copies on a CPU-only machine; the optimizer steps during backward without clipping;
    # in fp32 the parameter shard and the master are one slot on NVMe
    (("nvme", "nvme", "fp32", 1.0, CPU, 1, False), (N, H, N, False, True, StepperKind.NATIVE, False)),
    (("nvme", "nvme", "fp32", 0.0, CPU, 1, False), (N, H, N, False, True, StepperKind.NATIVE, True)),
    (("nvme", "nvme", "fp32", 0.0, CPU, 1, True), (N, H, N, False, True, StepperKind.NATIVE, False)),
    (("nvme", "cpu", "fp32", 1.0, CPU, 1, False), (N, H, H, False, False, StepperKind.NATIVE, False)),
    (("nvme", "nvme", "fp16", 0.0, CPU, 1, False), (N, H, N, False, False, StepperKind.NATIVE, False)),
    (("none", "nvme", "bf16", 0.0, CPU, 2, False), (D, D, N, False, False, StepperKind.NATIVE, True)),
    # several ranks always gather
    (("none", "none", "fp32", 1.0, CPU, 2, False), (D, D, D, False, True, StepperKind.TORCH, False)),
    (("cpu", "cpu", "fp32", 1.0, CPU, 2, False), (H, H, H, False, True, StepperKind.NATIVE, False)),
    # a GPU: host shards are not where the compute reads; gathers copy them to the device
    (("none", "none", "fp32", 1.0, GPU, 1, False), (D, D, D, True, True, StepperKind.TORCH, False)),
    (("cpu", "cpu", "fp32", 1.0, GPU, 1, False), (H, D, H, False, True, StepperKind.NATIVE, False)),
    (("none", "cpu", "fp32", 1.0, GPU, 1, False), (D, D, H, True, False, StepperKind.NATIVE, False)),
    (("nvme", "cpu", "bf16", 1.0, GPU, 2, False), (N, D, H, False, False, StepperKind.NATIVE, False)),
]


@pytest.mark.parametrize("inputs,expected", TABLE, ids=[str(i) for i, _ in TABLE])
def test_placement_table(inputs, expected) -> None:
    param, optim, dtype, clip, device, world, client = inputs
    p = resolve_placement(_config(param, optim, dtype, clip), device, world, client_optimizer=client)
    got = (p.param_home, p.gather_from, p.optim_home, p.params_resident, p.master_is_param, p.stepper)
    assert (*got, p.step_in_backward) == expected


def test_a_device_budget_on_a_cpu_only_machine_makes_gathers_copy_into_the_device_pool() -> None:
    p = resolve_placement(_config("cpu", "cpu", device_budget=1 << 20), CPU, 1, client_optimizer=False)
    assert p.gather_from is Tier.DEVICE and p.param_home is Tier.HOST and p.gather_waits_on == "host->device"


@pytest.mark.parametrize(
    "param,optim,host_budget,expected",
    [
        ("cpu", "cpu", None, MallocTuning.NONE),
        ("nvme", "cpu", None, MallocTuning.CAP_ARENAS),
        ("nvme", "nvme", 1 << 30, MallocTuning.RETURN_TO_OS),
    ],
)
def test_malloc_is_tuned_only_out_of_core(param, optim, host_budget, expected) -> None:
    p = resolve_placement(_config(param, optim, host_budget=host_budget), CPU, 1, client_optimizer=False)
    assert p.malloc is expected


@pytest.mark.parametrize(
    "dtype,optim,clip,accumulation,world,comm,expected",
    [
        ("bf16", "nvme", 1.0, 1, 1, None, torch.bfloat16),  # waits on NVMe as autograd computed it
        ("bf16", "nvme", 1.0, 1, 2, None, torch.bfloat16),  # reduced in bf16: still exactly bf16
        ("fp16", "nvme", 0.0, 1, 1, None, torch.float16),  # loss scaling waits for the overflow check
        ("bf16", "nvme", 1.0, 1, 1, "fp32", torch.bfloat16),  # one rank reduces nothing
        ("bf16", "nvme", 1.0, 1, 2, "fp32", torch.float32),  # a sum taken in fp32
        ("bf16", "nvme", 1.0, 2, 1, None, torch.float32),  # micro-batches summed in fp32
        ("bf16", "nvme", 0.0, 1, 1, None, torch.float32),  # stepped as it arrives: never stored
        ("bf16", "cpu", 1.0, 1, 1, None, torch.float32),  # a host accumulator
        ("fp32", "nvme", 1.0, 1, 1, None, torch.float32),
    ],
)
def test_a_gradient_waits_on_nvme_in_the_compute_dtype_where_that_is_exact(
    dtype, optim, clip, accumulation, world, comm, expected
) -> None:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clip,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
            "offload_optimizer": {"device": optim, "nvme_path": "/tmp"},
        },
        dtype: {"enabled": True},
    }
    if comm is not None:
        cfg["communication_data_type"] = comm
    if dtype == "fp32":
        del cfg["fp32"]
    p = resolve_placement(resolve_auto(resolve_batch_sizes(load_config(cfg), world), 64), CPU, world, False)
    assert p.grad_dtype == expected


SWEEP = list(
    itertools.product(
        ["none", "cpu", "nvme"], ["none", "cpu", "nvme"], ["fp32", "bf16", "fp16"], [0.0, 1.0], [CPU, GPU], [1, 2]
    )
)


@pytest.mark.parametrize("param,optim,dtype,clip,device,world", SWEEP)
def test_placement_invariants(param, optim, dtype, clip, device, world) -> None:
    p = resolve_placement(_config(param, optim, dtype, clip), device, world, client_optimizer=False)
    assert not p.params_resident or (world == 1 and p.param_home is not Tier.NVME)
    one_tier = p.param_home == p.optim_home or Tier.NVME not in (p.param_home, p.optim_home)
    assert not p.master_is_param or (dtype == "fp32" and one_tier)
    # during backward: the native stepper over a slow link (NVMe, or host memory under a GPU), nothing global
    slow_link = p.optim_home is Tier.NVME or (p.optim_home is Tier.HOST and device.type == "cuda")
    assert not p.step_in_backward or (slow_link and clip == 0 and dtype != "fp16")
    assert p.needs_grad_norm == (clip > 0 or dtype == "fp16")
    assert p.gather_from in (Tier.DEVICE, Tier.HOST)
    assert p.compute_in_host_memory == (p.gather_from is Tier.HOST)
    assert (p.stepper is StepperKind.TORCH) == (p.optim_home is Tier.DEVICE)
