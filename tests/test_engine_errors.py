"""Bad input to the engine: each is refused with an error that names the problem, and a dead or stuck rank
stops its peers within the configured timeout instead of hanging them."""

from __future__ import annotations

import functools
import re

import pytest
import torch
from dist import run_distributed
from engine_features_cases import batch_size_error_on_two_ranks, rank1_dies_mid_step, run_until_stopped
from harness import assert_weights_close, config, reference_for
from toy_models import batches, make_model

import infinity
from infinity.comm import CommError
from infinity.config import ConfigError

STEPS = 4

# -- the model -------------------------------------------------------------------------------------------


def test_initializing_the_same_model_twice_is_refused():
    model = make_model("mlp")
    infinity.initialize(model=model, config=config("mlp"))
    with pytest.raises(ValueError, match="already wrapped by an infinity engine"):
        infinity.initialize(model=model, config=config("mlp"))


class _NoInit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, 4))

    def forward(self, x):
        return x @ self.weight


def test_meta_model_without_an_initializer_is_refused_naming_the_module():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), _NoInit())
    with pytest.raises(ValueError, match=r"module '1' \(_NoInit\) has parameters on the meta device"):
        infinity.initialize(model=model, config=config("mlp"))


def test_block_classes_naming_a_class_absent_from_the_model_is_refused():
    with pytest.raises(ConfigError, match=r"block_classes' names \['Blokc'\].*MLPLayer"):
        infinity.initialize(model=make_model("mlp"), config=config("mlp", block_classes=("Blokc",)))


# -- the optimizer -----------------------------------------------------------------------------------------


def test_unsupported_client_optimizer_is_refused_by_name():
    model = make_model("mlp")
    with pytest.raises(ConfigError, match="optimizer SGD is not supported"):
        infinity.initialize(model=model, config=config("mlp"), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_client_adam_with_amsgrad_is_refused():
    model = make_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(ConfigError, match="amsgrad"):
        infinity.initialize(model=model, config=config("mlp"), optimizer=opt)


def test_a_refused_initialize_leaves_the_model_usable():
    model = make_model("mlp")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError):
        infinity.initialize(model=model, config=config("mlp"), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    engine, _, _, _ = infinity.initialize(model=model, config=config("mlp"))
    assert list(engine.full_state_dict()) == list(before)


# -- the training loop ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("offload", ["none", "nvme"])
@pytest.mark.parametrize("stepper", ["engine", "optimizer"])
def test_loss_backward_in_place_of_engine_backward_is_refused_at_the_step_and_nothing_is_stepped(
    tmp_path, offload, stepper
):
    """An FSDP-style loop: autograd alone would leave the root's gradients (the embedding, the head) with no one to
    reduce and step them, and the loss unscaled. The step is refused, naming the fix, and no weight moves."""
    cfg = config("gpt", offload_param=offload, offload_optimizer=offload, nvme_path=str(tmp_path))
    engine, optimizer, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    before = engine.full_state_dict()
    x, y = next(batches("gpt", 2))
    _, loss = engine(x, y)
    loss.backward()
    with pytest.raises(RuntimeError, match=r"'wte.weight' was made by loss.backward\(\).*call engine.backward\(loss\)"):
        (engine.step if stepper == "engine" else optimizer.step)()
    after = engine.full_state_dict()
    assert engine.global_steps == 0 and all(torch.equal(after[k], v) for k, v in before.items())
    engine.close()


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_second_backward_before_the_step_is_refused_naming_gradient_accumulation_steps(tmp_path, accumulation):
    """A plain-PyTorch accumulation loop (backward every micro-batch, step every Nth) with
    gradient_accumulation_steps N counted two micro-batches per step() and took half the steps, silently;
    with the optimizer stepping on NVMe during backward it ended in an internal KeyError. The second backward
    is refused before it touches a gradient; the loop the message gives trains on."""
    cfg = config("gpt", grad_accum=accumulation, clip=0.0, offload_param="nvme", offload_optimizer="nvme",
                 nvme_path=str(tmp_path), extra_zero={"host_budget_bytes": 64 << 20})  # fmt: skip
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    data = batches("gpt", 2)
    _, loss = engine(*next(data))
    engine.backward(loss)
    _, loss = engine(*next(data))
    message = rf"called twice without engine.step\(\).*gradient_accumulation_steps \(now {accumulation}\)"
    with pytest.raises(RuntimeError, match=message):
        engine.backward(loss)
    for _ in range(2 * accumulation):
        engine.step()
        _, loss = engine(*next(data))
        engine.backward(loss)
    engine.step()
    assert engine.global_steps == 2 + (accumulation == 1)
    engine.close()


@pytest.mark.parametrize("fp16", [False, True])
def test_the_returned_optimizers_step_clips_and_unscales_as_the_engines_does(fp16):
    """`engine.backward(loss); optimizer.step(); optimizer.zero_grad()` with the optimizer initialize returns (as
    FSDP users write it) steps as `engine.step()` does: clipped (fp32: equal to plain PyTorch with
    clip_grad_norm_), and in fp16 unscaled, with overflowing steps skipped. It used to step the raw gradients."""

    def run(use_optimizer: bool) -> tuple[list[float], dict[str, torch.Tensor], int]:
        cfg = config("gpt", clip=0.05)
        if fp16:
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 16}
        engine, optimizer, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
        data, losses = batches("gpt", 2), []
        for _ in range(STEPS):
            x, y = next(data)
            _, loss = engine(x, y)
            engine.backward(loss)
            optimizer.step() if use_optimizer else engine.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        state, skipped = engine.full_state_dict(), engine.skipped_steps
        engine.close()
        return losses, state, skipped

    losses, state, skipped = run(use_optimizer=True)
    engine_losses, engine_state, engine_skipped = run(use_optimizer=False)
    assert losses == engine_losses and skipped == engine_skipped
    assert all(torch.equal(state[k], v) for k, v in engine_state.items())
    if fp16:
        assert skipped > 0  # the first steps overflow at scale 2**16 and are skipped, not stepped
    else:
        ref_losses, ref_state, _ = reference_for("gpt", STEPS, 2, clip=0.05)
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert_weights_close(state, ref_state)


# -- the config ----------------------------------------------------------------------------------------------


def test_zero_stage_zero_is_refused_naming_the_stages_there_are():
    """Stages 1, 2 and 3 train (`test_zero_stages`); stage 0 is plain data parallelism."""
    cfg = config("mlp", extra_zero={"stage": 0})
    with pytest.raises(ConfigError, match=r"'zero_optimization.stage' is 0; infinity implements ZeRO stages 1, 2"):
        infinity.initialize(model=make_model("mlp"), config=cfg)


def test_unknown_top_level_key_suggests_the_closest_one():
    cfg = {**config("mlp"), "train_batch_szie": 4}
    with pytest.raises(ConfigError, match=r"unknown config key 'train_batch_szie'.*did you mean 'train_batch_size'"):
        infinity.initialize(model=make_model("mlp"), config=cfg)


def test_unknown_nested_key_names_its_path_and_suggests_the_closest_one():
    cfg = config("mlp", extra_zero={"offload_parm": {"device": "cpu"}})
    with pytest.raises(ConfigError, match=r"'zero_optimization\.offload_parm'.*did you mean 'offload_param'"):
        infinity.initialize(model=make_model("mlp"), config=cfg)


def test_unknown_optimizer_param_lists_the_known_ones():
    cfg = config("mlp")
    cfg["optimizer"]["params"]["weight_decya"] = 0.1
    with pytest.raises(ConfigError, match=r"'optimizer\.params' has unknown key\(s\) \['weight_decya'\].*weight_decay"):
        infinity.initialize(model=make_model("mlp"), config=cfg)


def test_inconsistent_batch_triple_shows_the_arithmetic():
    cfg = {**config("mlp", micro_bs=2, grad_accum=3), "train_batch_size": 8}
    with pytest.raises(ConfigError, match=r"train_batch_size \(8\) != .*\(2\) x .*\(3\) x world size \(1\) = 6"):
        infinity.initialize(model=make_model("mlp"), config=cfg)


def test_batch_sizes_that_two_ranks_cannot_share_are_refused_on_every_rank():
    base = {k: v for k, v in config("mlp").items() if k not in ("train_micro_batch_size_per_gpu",)}
    base.pop("gradient_accumulation_steps")
    alone = run_distributed(batch_size_error_on_two_ranks, 2, {**base, "train_batch_size": 3})
    with_micro = run_distributed(
        batch_size_error_on_two_ranks, 2, {**base, "train_batch_size": 3, "train_micro_batch_size_per_gpu": 1}
    )
    triple = run_distributed(
        batch_size_error_on_two_ranks,
        2,
        {**base, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},
    )
    for message in alone:
        assert message == "ConfigError: train_batch_size (3) is not divisible by the world size (2)"
    for message in with_micro:
        assert "train_batch_size (3) is not divisible by train_micro_batch_size_per_gpu (1) x world size (2)" in message
    for message in triple:
        assert message.startswith("ConfigError: train_batch_size (8) != train_micro_batch_size_per_gpu (2) x ")
        assert message.endswith("gradient_accumulation_steps (1) x world size (2) = 4")


# -- a rank that dies or hangs mid-step ----------------------------------------------------------------------

DIE_TIMEOUT_S = 10.0  # comm_timeout_s when rank 1 dies: a closed connection is noticed long before it
HANG_TIMEOUT_S = 2.0  # comm_timeout_s when rank 1 hangs: the survivor must wait about this long, then stop


@functools.cache
def _peer_failure(mode: str) -> tuple[str, dict]:
    timeout = DIE_TIMEOUT_S if mode == "dies" else HANG_TIMEOUT_S
    outcomes = run_until_stopped(rank1_dies_mid_step, 2, timeout, 2, mode == "hangs", timeout_s=timeout + 40)
    status, result = outcomes[0]
    return status, result


def test_peer_that_dies_mid_step_stops_the_survivor_within_the_timeout():
    status, result = _peer_failure("dies")
    assert status == "ok", f"rank 0 did not return: {status} {result}"
    assert result["step"] == 2, "rank 0 must fail in the step where rank 1 died"
    assert result["waited_s"] < DIE_TIMEOUT_S + 5


def test_peer_that_hangs_mid_step_stops_the_survivor_after_comm_timeout_s():
    status, result = _peer_failure("hangs")
    assert status == "ok", f"rank 0 did not return: {status} {result}"
    assert result["step"] == 2
    assert HANG_TIMEOUT_S * 0.5 <= result["waited_s"] < HANG_TIMEOUT_S + 10


@pytest.mark.parametrize("mode", ["dies", "hangs"])
def test_peer_failure_mid_step_raises_comm_error_naming_the_collective(mode):
    status, result = _peer_failure(mode)
    assert status == "ok"
    assert issubclass(result["type"], CommError), result
    # the blocks backward starts with stay gathered from forward: its first collective reduces gradients. Which
    # block's reduction notices the dead peer first depends on timing (an issue can fail before an earlier
    # reduction is waited for), so the message names the collective and some block's gradients.
    assert re.search(r"rank 0/2: reduce-scatter of gradients of (layers\.\d+|<root>)#\d+ failed", result["message"])


def test_a_host_budget_smaller_than_the_host_homed_shards_is_refused_before_anything_is_built():
    """cpu offload keeps parameter shards, masters, moments and gradient accumulators in host memory: an
    explicit host budget below their size is a ConfigError naming the key and the bytes needed."""
    model = make_model("mlp")
    cfg = config("mlp")
    cfg["zero_optimization"].update(
        {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}, "host_budget_bytes": 10_000}
    )
    with pytest.raises(ConfigError, match=r"host_budget_bytes' is 10000; the shards .* need (\d+) bytes") as info:
        infinity.initialize(model=model, config=cfg)
    needed = int(info.value.args[0].split(" need ")[1].split()[0])
    assert needed > 10_000 and needed % 4096 == 0  # whole 4 KiB buffers, as the pool hands them out
    cfg["zero_optimization"]["host_budget_bytes"] = needed + (4 << 20)  # and a budget that holds them works
    engine, _, _, _ = infinity.initialize(model=make_model("mlp"), config=cfg)
    assert engine.tiers.stats()["host"]["high_water_bytes"] >= needed
    engine.close()


def _bad_arguments():
    model = make_model("gpt")
    other = make_model("gpt")
    yield "model", {"model": "gpt"}, TypeError, "model must be a torch.nn.Module, got str"
    yield "config", {"model": model, "config": 5}, TypeError, "config must be a dict, a path to a JSON file"
    yield "params", {"model": model, "model_parameters": 5}, TypeError, "model_parameters must be an iterable"
    foreign = torch.optim.AdamW(other.parameters())
    yield "foreign optimizer", {"model": model, "optimizer": foreign}, ValueError, "the optimizer holds tensors that"
    foreign_group = [{"params": other.parameters(), "lr": 1e-3}]
    yield "foreign group", {"model": model, "model_parameters": foreign_group}, ValueError, "model_parameters holds"
    yield "scheduler", {"model": model, "lr_scheduler": 5}, TypeError, "lr_scheduler must be a scheduler"


@pytest.mark.parametrize("case", list(_bad_arguments()), ids=lambda c: c[0])
def test_arguments_initialize_cannot_train_with_are_named_up_front(case):
    _, kwargs, kind, message = case
    kwargs.setdefault("config", config(micro_bs=2))
    with pytest.raises(kind, match=re.escape(message)):
        infinity.initialize(**kwargs)


def test_param_groups_given_as_generators_are_read_once_and_trained():
    model = make_model("gpt")
    groups = [{"params": (p for p in model.parameters()), "weight_decay": 0.0}]
    engine = infinity.initialize(model=model, model_parameters=groups, config=config(micro_bs=2))[0]
    try:
        trained = sum(f.numel for f in engine.flats if f.requires_grad)
        assert trained == sum(p.numel() for p in make_model("gpt").parameters())  # every group's parameter, once
    finally:
        engine.close()
