"""The typed config: each kind of mistake is an error naming the key; "auto" resolves as Hugging Face's does."""

from __future__ import annotations

import json

import pytest

from infinity.config import (
    AutoValues,
    ConfigError,
    load_config,
    resolve_auto,
    resolve_batch_sizes,
    unresolved_auto_keys,
)

pytestmark = pytest.mark.unit


def _minimal(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, **extra}


# -- one test per kind of mistake ------------------------------------------------------------------


def test_unknown_top_level_key_names_the_closest_known_key():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'gradient_acumulation_steps'.*'gradient_accumulation_steps'"
    ):
        load_config(_minimal(gradient_acumulation_steps=2))


def test_unknown_nested_key_names_its_path_and_the_closest_key():
    cfg = _minimal(zero_optimization={"stage3_prefetch_bucket": 10})
    with pytest.raises(
        ConfigError, match=r"'zero_optimization\.stage3_prefetch_bucket'.*did you mean 'stage3_prefetch_bucket_size'"
    ):
        load_config(cfg)


def test_unknown_optimizer_param_names_the_closest_key():
    cfg = _minimal(optimizer={"type": "AdamW", "params": {"lr": 1e-3, "weight_decya": 0.1}})
    with pytest.raises(ConfigError, match=r"'optimizer\.params'.*'weight_decya'.*did you mean 'weight_decay'"):
        load_config(cfg)


def test_unknown_scheduler_param_names_the_closest_key_for_that_schedule():
    cfg = _minimal(scheduler={"type": "WarmupLR", "params": {"warmup_num_step": 10}})
    with pytest.raises(ConfigError, match=r"'scheduler\.params'.*WarmupLR.*did you mean 'warmup_num_steps'"):
        load_config(cfg)


def test_wrong_type_names_the_key_the_value_and_the_type_wanted():
    with pytest.raises(ConfigError, match=r"'train_micro_batch_size_per_gpu' must be an integer, got 'eight'"):
        load_config({"train_micro_batch_size_per_gpu": "eight"})
    with pytest.raises(ConfigError, match=r"'bf16\.enabled' must be true or false, got 1"):
        load_config(_minimal(bf16={"enabled": 1}))
    with pytest.raises(ConfigError, match=r"'optimizer\.params\.lr' must be a number, got '3e-4'"):
        load_config(_minimal(optimizer={"type": "AdamW", "params": {"lr": "3e-4"}}))


def test_value_out_of_range_names_the_key_the_value_and_the_bound():
    with pytest.raises(ConfigError, match=r"'gradient_accumulation_steps' is 0; it must be >= 1"):
        load_config(_minimal(gradient_accumulation_steps=0))
    with pytest.raises(ConfigError, match=r"'scheduler\.params\.cos_min_ratio' is 1\.5; it must be <= 1"):
        load_config(
            _minimal(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 1.5}})
        )


def test_value_outside_its_choices_lists_the_allowed_values():
    cfg = _minimal(zero_optimization={"offload_param": {"device": "gpu"}})
    with pytest.raises(
        ConfigError, match=r"'zero_optimization\.offload_param\.device' is 'gpu'; allowed values: 'none', 'cpu', 'nvme'"
    ):
        load_config(cfg)


def test_unsupported_optimizer_type_lists_the_supported_ones():
    with pytest.raises(ConfigError, match=r"'optimizer\.type' is 'Lamb'; allowed values: 'Adam', 'AdamW'"):
        load_config(_minimal(optimizer={"type": "Lamb"}))


def test_betas_must_be_two_numbers_below_one():
    cfg = _minimal(optimizer={"type": "Adam", "params": {"betas": [0.9, 1.0]}})
    with pytest.raises(ConfigError, match=r"'optimizer\.params\.betas' is \[0\.9, 1\.0\]; it must be two numbers"):
        load_config(cfg)


def test_required_scheduler_key_missing_is_named():
    with pytest.raises(ConfigError, match=r"'scheduler\.params' is missing required key\(s\): total_num_steps"):
        load_config(_minimal(scheduler={"type": "WarmupCosineLR", "params": {}}))


def test_inconsistent_batch_sizes_show_the_arithmetic():
    cfg = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    with pytest.raises(
        ConfigError,
        match=r"train_batch_size \(32\) != train_micro_batch_size_per_gpu \(4\) x gradient_accumulation_steps \(2\) "
        r"x world size \(2\) = 16",
    ):
        resolve_batch_sizes(cfg, world_size=2)


def test_indivisible_batch_size_shows_the_divisor():
    cfg = load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4})
    with pytest.raises(
        ConfigError, match=r"train_batch_size \(10\) is not divisible by .*\(4\) x world size \(1\) = 4"
    ):
        resolve_batch_sizes(cfg, world_size=1)


def test_integers_beyond_what_torch_holds_are_refused_naming_the_key():
    key = "train_micro_batch_size_per_gpu"
    with pytest.raises(ConfigError, match=rf"'{key}' is 1e\+30; it must be an integer below 2\*\*63"):
        load_config({key: 1e30})
    with pytest.raises(ConfigError, match=r"'zero_optimization\.sub_group_size' is 2361183241434822606848; .*2\*\*63"):
        load_config(_minimal(zero_optimization={"sub_group_size": 2**71}))
    with pytest.raises(ConfigError, match=r"'gradient_accumulation_steps' is 1000000000000\.0; it must be <= 1048576"):
        load_config(_minimal(gradient_accumulation_steps=1e12))
    cfg = load_config(_minimal(zero_optimization={"reduce_bucket_size": 5e8}))
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000  # DeepSpeed's way of writing sizes


def test_a_number_that_is_not_finite_is_refused():
    with pytest.raises(ConfigError, match=r"'gradient_clipping' is nan; it must be a finite number"):
        load_config(_minimal(gradient_clipping=float("nan")))


def test_a_null_optimizer_is_refused_and_an_absent_one_is_the_documented_default():
    with pytest.raises(ConfigError, match=r"'optimizer' is null: .*remove the key to train with the default \(AdamW"):
        load_config(_minimal(optimizer=None))
    assert load_config(_minimal()).optimizer is None  # the engine's AdamW at DeepSpeed's Adam defaults
    assert load_config(_minimal(scheduler=None)).scheduler is None  # null is the default: no schedule


def test_fp16_and_bf16_together_are_refused():
    with pytest.raises(ConfigError, match="'fp16.enabled' and 'bf16.enabled' are both true"):
        load_config(_minimal(fp16={"enabled": True}, bf16={"enabled": True}))


def test_compressed_moments_without_an_offloaded_optimizer_are_refused_by_key():
    cfg = _minimal(zero_optimization={"offload_optimizer": {"moments": "8bit"}})
    with pytest.raises(ConfigError, match=r"'zero_optimization\.offload_optimizer\.moments' is '8bit' but .*device"):
        load_config(cfg)
    with pytest.raises(ConfigError, match=r"moments' is 'int8'; allowed values: 'fp32', 'bf16', '8bit'"):
        load_config(_minimal(zero_optimization={"offload_optimizer": {"device": "cpu", "moments": "int8"}}))
    for device in ("cpu", "nvme"):
        for moments in ("fp32", "bf16", "8bit"):
            cfg = load_config(_minimal(zero_optimization={"offload_optimizer": {"device": device, "moments": moments}}))
            assert cfg.zero_optimization.offload_optimizer.moments == moments
    assert load_config(_minimal()).zero_optimization.offload_optimizer.moments == "fp32"


def test_auto_where_it_has_no_meaning_is_refused_by_key():
    with pytest.raises(ConfigError, match=r"'steps_per_print' does not accept \"auto\""):
        load_config(_minimal(steps_per_print="auto"))


def test_a_key_given_twice_under_its_alias_is_refused():
    with pytest.raises(ConfigError, match=r"'aio\.thread_count' is given twice"):
        load_config(_minimal(aio={"intra_op_parallelism": 2, "thread_count": 2}))


def test_bad_config_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "ds.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is a directory \(it holds ds\.json\); give the path of the JSON file"):
        load_config(tmp_path)
    broken = tmp_path / "broken.json"
    broken.write_text('{"train_batch_size": 4,}')
    with pytest.raises(ConfigError, match=r"broken\.json' is not valid JSON"):
        load_config(broken)


# -- batch sizes: any two given --------------------------------------------------------------------


@pytest.mark.parametrize(
    "given,world,expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        (
            {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
            2,
            (24, 4, 3),
        ),
        ({"train_batch_size": 8}, 4, (8, 2, 1)),
    ],
)
def test_batch_triple_is_completed_from_any_two(given, world, expected):
    cfg = resolve_batch_sizes(load_config(given), world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


# -- "auto" ----------------------------------------------------------------------------------------

HF_STYLE = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}
VALUES = AutoValues(
    micro_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=3e-4,
    adam_betas=(0.9, 0.95),
    adam_epsilon=1e-6,
    weight_decay=0.01,
    max_grad_norm=0.5,
    warmup_steps=10,
    total_steps=100,
    fp16=False,
    bf16=True,
)


def test_hf_style_auto_config_resolves_like_the_trainer():
    cfg = resolve_batch_sizes(resolve_auto(load_config(HF_STYLE), hidden_size=64, values=VALUES), world_size=2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (16, 4, 2)
    assert cfg.gradient_clipping == 0.5
    assert cfg.bf16.enabled is True and cfg.fp16.enabled is False
    assert cfg.compute_dtype_name == "bfloat16"
    assert cfg.optimizer.params == {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01}
    assert cfg.scheduler.params == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 10,
        "total_num_steps": 100,
    }
    z = cfg.zero_optimization  # HF's rules: h*h, 0.9*h*h, 10*h
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        4096,
        3686,
        640,
    )
    assert unresolved_auto_keys(cfg, include_batch=True) == []


def test_auto_values_given_explicitly_are_kept():
    raw = {**HF_STYLE, "gradient_clipping": 2.0}
    raw["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "betas": "auto"}}
    cfg = resolve_auto(load_config(raw), hidden_size=8, values=VALUES)
    assert cfg.gradient_clipping == 2.0
    assert cfg.optimizer.params == {"lr": 1e-2, "betas": [0.9, 0.95]}


def test_unresolvable_auto_is_an_error_naming_every_such_key():
    with pytest.raises(ConfigError) as info:
        resolve_auto(load_config(HF_STYLE), hidden_size=None, values=None)
    message = str(info.value)
    for key in (
        "optimizer.params.lr",
        "scheduler.params.total_num_steps",
        "bf16.enabled",
        "gradient_clipping",
        "zero_optimization.reduce_bucket_size",
    ):
        assert f"'{key}'" in message
    assert "hidden_size" in message
    assert "train_batch_size" not in message  # the batch triple's "auto" means "derive it"


def test_auto_batch_sizes_without_values_are_derived():
    cfg = resolve_batch_sizes(load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto"}), 2)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (8, 4, 1)


@pytest.mark.parametrize(
    "given,named",
    [
        ({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
         ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"},
         ["gradient_accumulation_steps"]),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2},
         ["train_micro_batch_size_per_gpu"]),
    ],
)  # fmt: skip
def test_auto_batch_sizes_nothing_determines_are_an_error_not_a_guess_of_one(given, named):
    """An HF-style config used through the Python API, where no Trainer fills "auto": accumulation "auto"
    used to become 1 silently (a run meant to accumulate 4 micro-batches stepped on each)."""
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(load_config(given), 2)
    message = str(info.value)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert (f"'{key}'" in message) == (key in named)
    assert "set it to a number" in message
    # absent keys keep DeepSpeed's defaults
    cfg = resolve_batch_sizes(load_config({"train_micro_batch_size_per_gpu": 4}), 2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (8, 1)


# -- the printed config ----------------------------------------------------------------------------


def test_to_dict_fills_every_default_including_optimizer_and_scheduler_params():
    cfg = load_config(_minimal(optimizer={"type": "Adam"}, scheduler={"type": "WarmupLR"}))
    out = json.loads(json.dumps(cfg.to_dict()))
    assert out["optimizer"]["params"] == {
        "lr": 1e-3,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.0,
        "adam_w_mode": True,
        "torch_adam": False,
        "amsgrad": False,
        "bias_correction": True,
    }
    assert out["scheduler"]["params"]["warmup_num_steps"] == 1000
    assert out["zero_optimization"]["offload_optimizer"]["buffer_count"] == 4
    assert out["aio"]["block_size"] == 1048576


def test_printed_defaults_agree_with_what_the_engine_uses():
    from infinity.config.params import AdamParams, WarmupCosineLRParams, WarmupDecayLRParams, WarmupLRParams
    from infinity.engine.param_groups import _DEFAULTS
    from infinity.optim.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

    adam = AdamParams()
    assert {k: getattr(adam, k) for k in _DEFAULTS} == _DEFAULTS
    for params, schedule in (
        (WarmupLRParams(), WarmupLR),
        (WarmupDecayLRParams(total_num_steps=1), WarmupDecayLR),
        (WarmupCosineLRParams(total_num_steps=1), WarmupCosineLR),
    ):
        for key, value in schedule._params.items():
            if value is not None:
                assert getattr(params, key) == value, (schedule.__name__, key)
