"""Keys that act only in some runs: set away from their default in a run where they cannot act, each gets one
notice at start naming it and why; in a run where they act, none. A run with every such key set trains to the
same weights, bit for bit, as one without them: the notices tell the truth."""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch
from harness import config, train_steps
from toy_models import batches, make_model

import infinity
from infinity.config import load_config, no_effect_notices


def _noticed(cfg: dict, **run) -> set[str]:
    """The dotted keys `no_effect_notices` names for `cfg` in the run `run` describes."""
    return {line.split("'")[1] for line in no_effect_notices(load_config(cfg), **run)}


REDUCTION = {"overlap_comm": False, "reduce_bucket_size": 1000}
SCALING = {"communication_data_type": "bf16", "prescale_gradients": True, "gradient_predivide_factor": 2.0}


def test_reduction_keys_are_idle_with_one_rank_and_act_with_two():
    cfg = config("mlp", extra=SCALING, extra_zero=REDUCTION)
    one = {"zero_optimization.overlap_comm", "zero_optimization.reduce_bucket_size", *SCALING}
    assert _noticed(cfg, world_size=1) == one
    # with two ranks: the bucket waits on overlap_comm, and a prescaled sum has no room for a predivide factor
    assert _noticed(cfg, world_size=2) == {"zero_optimization.reduce_bucket_size", "gradient_predivide_factor"}
    acting = config("mlp", extra={"communication_data_type": "fp32"}, extra_zero={"reduce_bucket_size": 1000})
    assert _noticed(acting, world_size=2) == set()
    assert _noticed(cfg) == {"gradient_predivide_factor"}  # world size not judged: the bucket is left alone


def test_timeouts_and_tag_validation_are_idle_with_one_rank_or_a_callers_group():
    cfg = config("mlp", extra={"checkpoint": {"tag_validation": "Fail"}}, extra_zero={"comm_timeout_s": 30.0})
    cfg["zero_optimization"]["heartbeat_timeout_s"] = 20.0
    timeouts = {"zero_optimization.comm_timeout_s", "zero_optimization.heartbeat_timeout_s"}
    assert _noticed(cfg, world_size=1) == {*timeouts, "checkpoint.tag_validation"}
    assert _noticed(cfg, world_size=2) == set()
    assert _noticed(cfg, world_size=2, group_given=True) == {"zero_optimization.comm_timeout_s"}


@pytest.mark.parametrize(
    "param,optim,budget,noticed",
    [
        ("none", "none", None, {"aio", "offload_param", "offload_optimizer"}),
        ("cpu", "cpu", None, {"aio", "offload_param", "offload_optimizer"}),
        ("none", "nvme", None, {"offload_param"}),
        ("nvme", "nvme", None, set()),
        ("nvme", "nvme", 1 << 33, {"read_ahead"}),
    ],
)
def test_nvme_keys_are_idle_without_nvme_and_the_read_ahead_under_a_host_budget(
    tmp_path, param, optim, budget, noticed
):
    cfg = config("mlp", offload_param=param, offload_optimizer=optim, nvme_path=str(tmp_path))
    z = cfg["zero_optimization"]
    z["host_budget_bytes"] = budget
    z["offload_param"].update(nvme_path=str(tmp_path), buffer_count=2, buffer_size=10_000, max_in_cpu=0)
    z["offload_optimizer"].update(nvme_path=str(tmp_path), recompute_gradients=False)
    cfg["aio"] = {"queue_depth": 4, "single_submit": True}
    read_ahead = {f"zero_optimization.offload_param.{k}" for k in ("buffer_count", "buffer_size", "max_in_cpu")}
    groups = {
        "aio": {"aio.queue_depth", "aio.single_submit"},
        "offload_param": {"zero_optimization.offload_param.nvme_path", *read_ahead},
        "offload_optimizer": {f"zero_optimization.offload_optimizer.{k}" for k in ("nvme_path", "recompute_gradients")},
        "read_ahead": read_ahead,
    }
    assert _noticed(cfg, world_size=1) == set().union(*(groups[g] for g in noticed))


@pytest.mark.parametrize(
    "fp16,noticed",
    [
        ({"enabled": False, "loss_scale": 64.0}, {"loss_scale", "loss_scale_window", "hysteresis"}),
        ({"enabled": True}, set()),
        ({"enabled": True, "loss_scale": 128.0}, {"loss_scale_window", "hysteresis"}),
    ],
)
def test_fp16_scaling_keys_are_idle_while_fp16_is_off_and_dynamic_ones_under_a_static_scale(fp16, noticed):
    cfg = config("mlp", extra={"fp16": {"loss_scale_window": 50, "hysteresis": 3, **fp16}})
    assert _noticed(cfg) == {f"fp16.{k}" for k in noticed}


def test_profiler_settings_are_idle_while_it_is_off_and_block_size_beside_block_classes(tmp_path):
    profiler = {"path": str(tmp_path), "start_step": 3}
    cfg = config("mlp", extra={"profiler": profiler}, extra_zero={"block_size_elems": 1000})
    assert _noticed(cfg) == {"profiler.path", "profiler.start_step", "zero_optimization.block_size_elems"}
    cfg = config("mlp", extra={"profiler": {**profiler, "enabled": True}}, extra_zero={"block_size_elems": 1000})
    cfg["zero_optimization"]["block_classes"] = []
    assert _noticed(cfg) == set()


def test_the_optimizer_keys_its_choice_ignores():
    cfg = config("mlp", extra={"optimizer": {"type": "AdamW", "params": {"lr": 0.1, "torch_adam": True}}})
    assert _noticed(cfg) == {"optimizer.params.torch_adam"}
    cfg["optimizer"]["params"]["adam_w_mode"] = False
    assert _noticed(cfg) == {"optimizer.params.torch_adam", "optimizer.params.adam_w_mode"}
    cfg["optimizer"]["type"] = "Adam"  # adam_w_mode false means L2 regularization for Adam: it acts
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01}}
    assert _noticed(cfg) == {"optimizer.params.torch_adam", "optimizer.params.lr"}
    cfg["scheduler"]["params"]["warmup_max_lr"] = 0.1  # the same peak: nothing to be misled by
    assert _noticed(cfg) == {"optimizer.params.torch_adam"}
    assert _noticed(cfg, client_optimizer=True, client_scheduler=True) == {"optimizer", "scheduler"}


IDLE_AT_ONE_RANK_ON_CPU = {
    "extra": {**SCALING, "fp16": {"loss_scale_window": 7}, "profiler": {"start_step": 5}, "aio": {"queue_depth": 3}},
    "extra_zero": {**REDUCTION, "comm_timeout_s": 30.0, "heartbeat_timeout_s": 9.0, "block_size_elems": 77},
}
OPTIMIZER_STAGING = {"buffer_count": 1, "pipeline_read": False, "pipeline_write": False}


def _train(cfg: dict, client: bool) -> tuple[dict[str, torch.Tensor], str]:
    model = make_model("mlp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) if client else None
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0) if client else None
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        engine = infinity.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule, config=cfg)[0]
    with warnings.catch_warnings():  # the engine steps the client's schedule after its own step: torch must not
        warnings.simplefilter("error")  # warn that the schedule stepped before the (client) optimizer
        train_steps(engine, batches("mlp", 2), 3)
    state = engine.full_state_dict()
    engine.close()
    return state, err.getvalue()


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_a_run_with_every_idle_key_set_trains_bit_for_bit_as_one_without_and_names_each(offload):
    plain, quiet = _train(config("mlp", offload_param=offload, offload_optimizer=offload), client=False)
    assert "no effect" not in quiet
    cfg = config("mlp", offload_param=offload, offload_optimizer=offload, **IDLE_AT_ONE_RANK_ON_CPU)
    cfg["zero_optimization"]["offload_optimizer"].update(OPTIMIZER_STAGING)  # in memory: nothing staged
    idle, printed = _train(cfg, client=False)
    for name, t in plain.items():
        assert torch.equal(idle[name], t), name
    keys = [*IDLE_AT_ONE_RANK_ON_CPU["extra"], *IDLE_AT_ONE_RANK_ON_CPU["extra_zero"]]
    keys += [f"offload_optimizer.{k}" for k in OPTIMIZER_STAGING]
    for key in keys:
        assert any(f"{key}" in line and "no effect" in line for line in printed.splitlines()), key


def test_a_client_optimizer_and_scheduler_override_the_config_sections_and_say_so():
    base = config("mlp")  # AdamW(lr=1e-2, weight_decay=0.1): what the client optimizer is too
    plain, _ = _train(base, client=True)
    cfg = config("mlp", extra={"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.5}}})
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 0.3, "weight_decay": 0.5, "adam_w_mode": False}}
    overridden, printed = _train(cfg, client=True)
    for name, t in plain.items():
        assert torch.equal(overridden[name], t), name
    assert "'optimizer' is 'Adam'" in printed and "the optimizer passed to initialize" in printed
    assert "'scheduler' is 'WarmupLR'" in printed and "the lr_scheduler passed to initialize" in printed


STAGE3_SCHEDULING = {
    "stage3_prefetch_bucket_size": 1000,
    "stage3_max_live_parameters": 5000,
    "stage3_max_reuse_distance": 0,
}


@pytest.mark.parametrize("stage", [1, 2])
def test_stage3_scheduling_keys_are_idle_at_stages_1_and_2_train_bit_for_bit_and_are_named(stage):
    keys = {f"zero_optimization.{k}" for k in STAGE3_SCHEDULING}
    assert not _noticed(config("mlp", extra_zero=STAGE3_SCHEDULING), world_size=2) & keys  # stage 3: they act
    plain, quiet = _train(config("mlp", offload_optimizer="cpu", extra_zero={"stage": stage}), client=False)
    assert "no effect" not in quiet
    cfg = config("mlp", offload_optimizer="cpu", extra_zero={"stage": stage, **STAGE3_SCHEDULING})
    assert _noticed(cfg, world_size=2) == keys
    idle, printed = _train(cfg, client=False)
    for name, t in plain.items():
        assert torch.equal(idle[name], t), name
    for key in keys:
        assert any(key in line and f"no effect at stage {stage}" in line for line in printed.splitlines()), key


@pytest.mark.parametrize("device,cuda,noticed", [("none", None, True), ("cpu", False, True), ("cpu", True, False)])
def test_the_optimizers_staging_keys_are_idle_where_its_state_is_stepped_in_place(tmp_path, device, cuda, noticed):
    cfg = config("mlp", offload_optimizer=device)
    cfg["zero_optimization"]["offload_optimizer"].update(OPTIMIZER_STAGING)
    staging = {f"zero_optimization.offload_optimizer.{k}" for k in OPTIMIZER_STAGING}
    assert (_noticed(cfg, cuda=cuda) & staging == staging) is noticed
    on_nvme = config("mlp", offload_optimizer="nvme", nvme_path=str(tmp_path))
    on_nvme["zero_optimization"]["offload_optimizer"].update(OPTIMIZER_STAGING)
    assert not _noticed(on_nvme, cuda=False) & staging  # they pace the state's reads and writes
