"""Adam's moments stored in bf16 or 8 bits (`offload_optimizer.moments`) through the whole engine.

The kernels' bit-equality with a plain-PyTorch reference of each format is `test_cpu_adam_moments`;
here: training ends within 1% of the fp32-moment loss, resume is bit-exact in each format, the NVMe
swap holds the format's bytes, and a checkpoint moves between formats.
"""

from __future__ import annotations

import pytest
import torch
from harness import config, train_steps
from toy_models import batches, make_model

import infinity
from infinity.shards.moments import moment_format
from infinity.storage import Tier

STEPS = 60
MICRO_BS = 4


def _config(offload: str, moments: str, nvme_path: str) -> dict:
    cfg = config(
        micro_bs=MICRO_BS, persistence=64, offload_param=offload, offload_optimizer=offload, nvme_path=nvme_path
    )
    cfg["optimizer"]["params"]["lr"] = 3e-3
    cfg["zero_optimization"]["offload_optimizer"]["moments"] = moments
    return cfg


def _run(offload: str, moments: str, nvme_path: str, steps: int = STEPS) -> tuple[list[float], dict, int]:
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=_config(offload, moments, nvme_path))
    losses = train_steps(engine, batches("gpt", MICRO_BS), steps)
    nvme_bytes = engine.tiers.high_water_bytes(Tier.NVME)
    state = engine.full_state_dict()
    engine.close()
    return losses, state, nvme_bytes


def _tail(losses: list[float]) -> float:
    return sum(losses[-10:]) / 10


@pytest.mark.parametrize("offload", ["cpu", "nvme"])
@pytest.mark.parametrize("moments", ["bf16", "8bit"])
def test_compressed_moments_train_within_one_percent_of_fp32(tmp_path, offload, moments):
    exact, _, fp32_disk = _run(offload, "fp32", str(tmp_path))
    compressed, _, disk = _run(offload, moments, str(tmp_path))
    assert _tail(compressed) == pytest.approx(_tail(exact), rel=0.01)
    assert compressed != exact  # the format is really in use
    if offload == "nvme":  # the swap holds the format's bytes: less than fp32's 8 bytes an element
        assert disk < fp32_disk


def test_the_swap_holds_the_moment_format_bytes(tmp_path):
    """Per trainable shard on NVMe in fp32: one master/parameter slot (4 B an element) and the moments
    (the format's packed bytes), each rounded up to 4 KiB; gradients take no slot (no accumulation)."""
    for moments in ("fp32", "8bit"):
        engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=_config("nvme", moments, str(tmp_path)))
        pad = lambda n: -(-n // 4096) * 4096  # noqa: E731
        fmt = moment_format(moments)
        expected = sum(pad(4 * f.shard_numel) for f in engine.flats)
        expected += sum(pad(fmt.state_bytes(f.shard_numel)) for f in engine.shards.records)
        assert engine.tiers.live_bytes(Tier.NVME) == expected
        engine.close()


@pytest.mark.parametrize("moments", ["bf16", "8bit"])
def test_resume_is_bit_exact_in_each_moment_format(tmp_path, moments):
    nvme, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    straight, straight_state, _ = _run("nvme", moments, nvme, steps=6)
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=_config("nvme", moments, nvme))
    data = batches("gpt", MICRO_BS)
    first = train_steps(engine, data, 3)
    engine.save_checkpoint(ckpt)
    engine.close()
    engine, _, _, _ = infinity.initialize(model=make_model("gpt", seed=3), config=_config("nvme", moments, nvme))
    engine.load_checkpoint(ckpt)
    rest = train_steps(engine, data, 3)
    assert first + rest == straight
    assert all(torch.equal(engine.full_state_dict()[k], v) for k, v in straight_state.items())
    engine.close()


def test_a_checkpoint_moves_between_moment_formats(tmp_path):
    """8-bit moments saved, loaded into an fp32-moment run (decoded), and back (re-encoded): training
    continues from the same weights with moments equal to the decoded ones."""
    nvme, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=_config("cpu", "8bit", nvme))
    data = batches("gpt", MICRO_BS)
    train_steps(engine, data, 3)
    engine.save_checkpoint(ckpt)
    saved = engine.full_state_dict()
    decoded = {}
    from infinity.shards.moments import decode

    for flat in engine.shards.records:
        stored = engine.shards.read_moments(flat)
        decoded[flat.name] = decode(stored["exp_avg"], stored["exp_avg_scale"], "8bit", "exp_avg")
    engine.close()
    other, _, _, _ = infinity.initialize(model=make_model("gpt", seed=3), config=_config("cpu", "fp32", nvme))
    other.load_checkpoint(ckpt)
    assert all(torch.equal(other.full_state_dict()[k], v) for k, v in saved.items())
    for flat in other.shards.records:
        assert torch.equal(other.shards.read_moments(flat)["exp_avg"], decoded[flat.name])
    losses = train_steps(other, data, 3)
    assert all(loss == loss and loss < 10 for loss in losses)  # finite, trains on
    other.close()
