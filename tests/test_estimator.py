"""The memory estimator against hand computation (see the layout in infinity/estimator.py's docstring)."""

from __future__ import annotations

import pytest

from infinity.cli import main
from infinity.estimator import (
    Machine,
    ModelSize,
    estimate,
    fits,
    gpt_model_size,
    largest_fitting_params,
    size_from_params,
)
from infinity.models.gpt import count_params, gpt_preset

pytestmark = pytest.mark.unit

P, L = 1_000_000_000, 100_000_000  # parameters, largest block
GPUS, NODES = 2, 2  # N = 4 ranks: shard S = 2.5e8, block shard B = 2.5e7
S, B = 250_000_000, 25_000_000
WORK_BF16 = (3 * 2 + 4) * L  # gathered running + prefetched block, bf16 grads, fp32 grads


@pytest.mark.parametrize(
    "param,optim,device,host,nvme",
    [
        ("none", "none", WORK_BF16 + 2 * S + 16 * S, 0, 0),
        ("none", "cpu", WORK_BF16 + 2 * S, GPUS * 16 * S, 0),
        ("cpu", "cpu", WORK_BF16, GPUS * 18 * S, 0),
        ("none", "nvme", WORK_BF16 + 2 * S, GPUS * 4 * (4 * 5 + 1) * B, GPUS * 16 * S),
        ("cpu", "nvme", WORK_BF16, GPUS * (2 * S + 84 * B), GPUS * 16 * S),
        ("nvme", "nvme", WORK_BF16, GPUS * (2 * 500_000_000 + 84 * B), GPUS * 18 * S),
    ],
)
def test_bf16_needs_match_hand_computation(param, optim, device, host, nvme):
    need = estimate(ModelSize(P, L), param, optim, gpus_per_node=GPUS, nodes=NODES, dtype_bytes=2)
    assert (need.device_bytes, need.host_bytes, need.nvme_bytes) == (device, host, nvme)


def test_no_offload_model_states_are_deepspeeds_18_bytes_per_parameter_per_rank():
    # DeepSpeed: 2 (fp16 weights) + 4 (fp32 grads) + 12 (fp32 master, m, v) bytes per parameter, split over ranks.
    size = ModelSize(P, 0)
    assert estimate(size, "none", "none", gpus_per_node=8, nodes=1).device_bytes == 18 * P // 8


def test_fp32_master_shares_the_weight_shard_when_both_live_in_one_memory_tier():
    size = ModelSize(P, L)
    assert estimate(size, "cpu", "cpu", 1, 1, dtype_bytes=4).host_bytes == 16 * P
    assert estimate(size, "cpu", "nvme", 1, 1, dtype_bytes=4).nvme_bytes == 16 * P  # different tiers: no sharing
    assert estimate(size, "nvme", "nvme", 1, 1, dtype_bytes=4).nvme_bytes == 20 * P  # NVMe keeps separate copies


def test_gpt_preset_is_counted_on_the_meta_device():
    size = gpt_model_size("tiny")
    assert size.total_params == count_params(gpt_preset("tiny")) == 34_688
    # tiny: n_embd 32. A block: two LayerNorms (2*64) + 12*32^2 weights + 288 biases; the root: wte 256*32,
    # wpe 32*32, ln_f 64 (the head is tied to wte).
    assert size.largest_block_params == max(128 + 12 * 32 * 32 + 288, 256 * 32 + 32 * 32 + 64) == 12_704
    big = gpt_model_size("13b")  # 13B parameters are never allocated
    assert big.total_params == count_params(gpt_preset("13b"))


def test_bare_parameter_count_guesses_a_gpt_shaped_largest_block():
    size = size_from_params(13e9)
    hidden = (13e9 * 128 / 12) ** (1 / 3)  # depth ~ hidden/128, as in GPT-3 13B (5120 wide, 40 deep)
    assert size.largest_block_params == int(12 * hidden * hidden)
    assert 5000 < hidden < 5300


def test_largest_fitting_model_is_the_boundary_of_the_fit():
    machine = Machine(device_bytes=10**15, devices=1, host_bytes=180 * 10**9, nvme_bytes=0, nvme_path="/x")
    n = largest_fitting_params(machine, "cpu", "cpu")
    # Host holds 18 bytes per parameter (bf16 weights + fp32 master, moments, grads): 180 GB / 18 = 10B.
    assert n == pytest.approx(10**10, rel=1e-3)
    assert fits(estimate(size_from_params(n), "cpu", "cpu"), machine)
    assert not fits(estimate(size_from_params(n * 1.001), "cpu", "cpu"), machine)


def test_without_a_gpu_device_and_host_share_the_memory():
    need = estimate(ModelSize(P, L), "none", "cpu")
    both = need.device_bytes + need.host_bytes
    assert fits(need, Machine(None, 1, both, 0, "/x"))
    assert not fits(need, Machine(None, 1, both - 1, 0, "/x"))


def test_estimate_command_prints_every_offload_choice_and_the_largest_fit(capsys):
    assert main(["estimate", "--params", "13e9", "--gpus", "8", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "13.00B parameters" in out and "2 node(s) x 8 GPU(s)" in out
    for param, optim in (("none", "none"), ("cpu", "cpu"), ("nvme", "nvme")):
        assert any(line.split()[:2] == [param, optim] for line in out.splitlines())
    assert "Largest overall:" in out
    assert main(["estimate", "--model", "tiny"]) == 0
    assert "34.69K parameters" in capsys.readouterr().out
