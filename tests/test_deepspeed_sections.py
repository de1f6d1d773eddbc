"""DeepSpeed's keys for machinery infinity lacks (`DEEPSPEED_ONLY`): a ds_config.json carrying them switched off
loads in silence; one asking a monitor or logger for something loads with its one notice; one asking for a
feature infinity does not implement is refused, naming the key. Such a config trains bit for bit as the same
config without those sections."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from harness import config
from test_config_notices import _train as train_and_print

from infinity.config import DEEPSPEED_ONLY, ConfigError, load_config, no_effect_notices

# as published DeepSpeed, Megatron-DeepSpeed and Hugging Face configs write them: off, or at DeepSpeed's default
SECTIONS_OFF = {
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "zero_force_ds_cpu_optimizer": True,
    "memory_breakdown": False,
    "dump_state": False,
    "sparse_gradients": False,
    "fp32_allreduce": False,
    "data_types": {"grad_accum_dtype": "fp32"},
    "amp": {"enabled": "auto", "opt_level": "auto"},
    "bf16": {"enabled": False, "immediate_grad_update": False, "check_grad_overflow": False},
    "activation_checkpointing": {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    },
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 1, "detailed": True},
    "tensorboard": {"enabled": False, "output_path": "logs/tensorboard/", "job_name": "train"},
    "wandb": {"enabled": False, "project": "my-project"},
    "csv_monitor": {"enabled": False, "output_path": "logs/csv/", "job_name": "train"},
    "comet": {"enabled": False, "project": "my-project"},
    "comms_logger": {"enabled": False, "verbose": False, "prof_all": True, "debug": False},
    "compile": {"deepcompile": False},
    "elasticity": {"enabled": False, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1},
    "autotuning": {"enabled": False, "fast": True, "metric": "throughput"},
    "data_efficiency": {"enabled": False, "seed": 1234, "data_sampling": {"num_workers": 0}},
    "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen", "min_difficulty": 8},
}
ZERO_OFF = {
    "load_from_fp32_weights": True,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_gradients": False,
    "zero_quantized_nontrainable_weights": False,
    "mics_shard_size": -1,
    "mics_hierarchical_params_gather": False,
    "stage3_model_persistence_threshold": sys.maxsize,
    "use_multi_rank_bucket_allreduce": True,
    "legacy_stage1": False,
    "cpu_offload": False,
    "cpu_offload_param": False,
    "cpu_offload_use_pin_memory": False,
    "memory_efficient_linear": True,
}

# a value that asks for something, for every key of the table
ASKING = {
    "tensorboard.enabled": True,
    "wandb.enabled": True,
    "csv_monitor.enabled": True,
    "comet.enabled": True,
    "flops_profiler.enabled": True,
    "comms_logger.enabled": True,
    "memory_breakdown": True,
    "dump_state": True,
    "activation_checkpointing.synchronize_checkpoint_boundary": True,
    "activation_checkpointing.profile": True,
    "activation_checkpointing.number_checkpoints": 4,
    "zero_force_ds_cpu_optimizer": False,
    "zero_optimization.load_from_fp32_weights": False,
    "zero_optimization.stage3_model_persistence_threshold": 100_000,
    "zero_optimization.use_multi_rank_bucket_allreduce": False,
    "zero_optimization.mics_hierarchical_params_gather": True,
    "zero_optimization.legacy_stage1": True,
    "zero_optimization.memory_efficient_linear": False,
    "zero_optimization.cpu_offload_use_pin_memory": True,
    "bf16.immediate_grad_update": True,
    "data_types.grad_accum_dtype": "bf16",
    "amp.enabled": True,
    "torch_autocast.enabled": True,
    "bf16.check_grad_overflow": True,
    "bf16.bf16_master_weights_and_grads": True,
    "bf16.bf16_optimizer_states": True,
    "zero_optimization.zero_quantized_weights": True,
    "zero_optimization.zero_quantized_nontrainable_weights": True,
    "zero_optimization.zero_quantized_gradients": True,
    "zero_optimization.zero_hpz_partition_size": 8,
    "zero_optimization.mics_shard_size": 8,
    "zero_optimization.cpu_offload": True,
    "zero_optimization.cpu_offload_param": True,
    "sparse_gradients": True,
    "fp32_allreduce": True,
    "activation_checkpointing.partition_activations": True,
    "activation_checkpointing.cpu_checkpointing": True,
    "activation_checkpointing.contiguous_memory_optimization": True,
    "compile.enabled": True,
    "compile.deepcompile": True,
    "elasticity.enabled": True,
    "autotuning.enabled": True,
    "data_efficiency.enabled": True,
    "curriculum_learning.enabled": True,
    "progressive_layer_drop.enabled": True,
}
NOTICED = [key for key, entry in DEEPSPEED_ONLY.items() if not entry.refused]
REFUSED = [key for key, entry in DEEPSPEED_ONLY.items() if entry.refused]
# what a run that asks every monitor and logger for something adds to SECTIONS_OFF
MONITORS_ON = {
    "tensorboard": {"enabled": True, "output_path": "logs/tensorboard/", "job_name": "train"},
    "wandb": {"enabled": True, "project": "my-project"},
    "flops_profiler": {"enabled": True, "profile_step": 1},
    "comms_logger": {"enabled": True, "prof_all": True},
    "memory_breakdown": True,
    "zero_force_ds_cpu_optimizer": False,
}


def _with(key: str, value: object) -> dict:
    """config("mlp") with dotted `key` set to `value` (sections created as needed)."""
    cfg = config("mlp")
    *parents, last = key.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return cfg


def test_every_key_of_the_table_has_an_asking_value_here():
    assert set(ASKING) == set(DEEPSPEED_ONLY)


def test_a_published_style_ds_config_with_the_sections_switched_off_loads_from_its_file_in_silence(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config("mlp", extra=SECTIONS_OFF, extra_zero=ZERO_OFF)))
    cfg = load_config(path)
    assert cfg.deepspeed_only == ()
    assert no_effect_notices(cfg) == []
    assert cfg == load_config(config("mlp"))  # the typed config is the one without the sections
    assert load_config(cfg.to_dict()).to_dict() == cfg.to_dict()  # the resolved config round-trips without them


@pytest.mark.parametrize("key", NOTICED)
def test_a_key_without_effect_asking_for_something_gets_exactly_its_notice(key):
    notices = no_effect_notices(load_config(_with(key, ASKING[key])))
    why = DEEPSPEED_ONLY[key].why
    assert notices == [f"infinity: '{key}' is {ASKING[key]!r}: accepted, but it has no effect in infinity: {why}"]


@pytest.mark.parametrize("key", REFUSED)
def test_a_feature_infinity_does_not_implement_is_refused_when_on_naming_the_key(key):
    with pytest.raises(ConfigError, match=rf"^'{key}' is {ASKING[key]!r}: infinity does not implement"):
        load_config(_with(key, ASKING[key]))


@pytest.mark.parametrize(
    "key,instead",
    [
        ("zero_optimization.cpu_offload", '"offload_optimizer": {"device": "cpu"}'),
        ("zero_optimization.cpu_offload_param", '"offload_param": {"device": "cpu"}'),
        ("fp32_allreduce", '"communication_data_type": "fp32"'),
        ("amp.enabled", '"bf16": {"enabled": true}'),
        ("autotuning.enabled", "infinity tune"),
        ("bf16.bf16_optimizer_states", 'offload_optimizer.moments "bf16"'),
    ],
)
def test_a_refusal_names_the_infinity_key_that_does_the_job(key, instead):
    with pytest.raises(ConfigError) as err:
        load_config(_with(key, ASKING[key]))
    assert instead in str(err.value)


def test_the_bfloat16_spelling_of_bf16_is_judged_under_bf16():
    cfg = config("mlp", extra={"bfloat16": {"enabled": False, "immediate_grad_update": True}})
    assert [n.split("'")[1] for n in no_effect_notices(load_config(cfg))] == ["bf16.immediate_grad_update"]
    cfg["bfloat16"]["check_grad_overflow"] = True
    with pytest.raises(ConfigError, match=r"'bf16\.check_grad_overflow'"):
        load_config(cfg)


def test_a_section_that_is_not_an_object_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"'tensorboard' must be an object"):
        load_config(config("mlp", extra={"tensorboard": True}))


@pytest.mark.parametrize(
    "key,suggested",
    [
        ("tensorbord", "tensorboard"),
        ("activation_checkpoint", "activation_checkpointing"),
        ("flops_profile", "flops_profiler"),
        ("data_type", "data_types"),
        ("gradient_acumulation_steps", "gradient_accumulation_steps"),
    ],
)
def test_a_misspelled_key_is_still_refused_with_the_closest_key(key, suggested):
    with pytest.raises(ConfigError, match=rf"unknown config key '{key}' at the top level: did you mean '{suggested}'"):
        load_config(config("mlp", extra={key: {}}))


def test_a_misspelled_zero_key_is_pointed_at_its_deepspeed_name():
    cfg = config("mlp", extra_zero={"zero_quantized_weight": False})
    with pytest.raises(ConfigError, match=r"'zero_optimization\.zero_quantized_weight'.*'zero_quantized_weights'"):
        load_config(cfg)


@pytest.mark.parametrize("key", ["activation_checkpointing", "flops_profiler", "data_types"])
def test_deepspeed_sections_once_pointed_at_unrelated_infinity_keys_now_load(key):
    load_config(config("mlp", extra={key: SECTIONS_OFF[key]}))


def test_the_notices_list_is_not_a_json_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'deepspeed_only'"):
        load_config(config("mlp", extra={"deepspeed_only": []}))


def _train(cfg: dict) -> tuple[dict[str, torch.Tensor], str]:
    return train_and_print(cfg, client=False)


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_a_config_with_the_deepspeed_sections_trains_bit_for_bit_as_one_without_and_names_each_monitor(offload):
    plain, quiet = _train(config("mlp", offload_param=offload, offload_optimizer=offload))
    assert "no effect" not in quiet
    extra = {**SECTIONS_OFF, **MONITORS_ON}
    cfg = config("mlp", offload_param=offload, offload_optimizer=offload, extra=extra, extra_zero=ZERO_OFF)
    with_sections, printed = _train(cfg)
    for name, t in plain.items():
        assert torch.equal(with_sections[name], t), name
    noticed = ["tensorboard.enabled", "wandb.enabled", "flops_profiler.enabled", "comms_logger.enabled"]
    noticed += ["memory_breakdown", "zero_force_ds_cpu_optimizer"]
    lines = [line for line in printed.splitlines() if "no effect in infinity" in line]
    assert sorted(line.split("'")[1] for line in lines) == sorted(noticed)
