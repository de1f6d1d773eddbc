"""The DeepSpeed keys of issue 15: each one changes what it says, or its no-effect notice is printed.

Effects are checked against an independent reference: plain PyTorch training, DeepSpeed's formula for
the reduced gradient applied by hand to gradients the test chose, the generators seeded by hand, the
engine's own full weights for the consolidated file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from config_keys_cases import (
    draws_after_initialize,
    initialize_and_capture,
    meta_mlp_initial_weights,
    plain_with_unused,
    probe_gradients,
    reduced_probe_gradient,
    save_16bit,
    timed_steps,
    train_with_unused,
)
from dist import run_distributed
from harness import assert_weights_close, config, mean_losses, reference_for, train_on_rank
from toy_models import make_model

import infinity
from infinity.config import NO_EFFECT, InfinityConfig, load_config, no_effect_notices
from infinity.engine.checkpoint_folder import verify_checkpoint

# -- prescale_gradients / gradient_predivide_factor ---------------------------------------------------------


def _expected_reduction(g0: torch.Tensor, g1: torch.Tensor, prescale: bool, factor: float) -> torch.Tensor:
    """DeepSpeed's all-reduce scaling for two ranks, in fp32: prescaled, divide by the world size before the
    sum; otherwise divide by the factor before and by world size / factor after."""
    if prescale:
        return g0 / 2 + g1 / 2
    summed = g0 / factor + g1 / factor if factor != 1 else g0 + g1
    return summed / (2 / factor)


@pytest.mark.parametrize(
    "prescale,factor", [(False, 1.0), (True, 1.0), (False, 3.0), (False, 2.0)], ids=["default", "prescale", "f3", "f2"]
)
def test_the_reduced_gradient_is_deepspeeds_scaling_of_the_ranks_gradients(prescale, factor):
    extra = {"prescale_gradients": prescale, "gradient_predivide_factor": factor}
    results = run_distributed(reduced_probe_gradient, 2, extra, False)
    expected = _expected_reduction(probe_gradients(0, False), probe_gradients(1, False), prescale, factor)
    for r in results:
        assert torch.equal(r["shard"][: r["end"] - r["start"]], expected[r["start"] : r["end"]])


def test_a_predivide_factor_rounds_differently_from_the_plain_mean():
    g0, g1 = probe_gradients(0, False), probe_gradients(1, False)
    assert not torch.equal(_expected_reduction(g0, g1, False, 3.0), _expected_reduction(g0, g1, False, 1.0))


@pytest.mark.parametrize("extra", [{"prescale_gradients": True}, {"gradient_predivide_factor": 4.0}])
def test_pre_dividing_keeps_a_sum_near_the_fp32_limit_finite(extra):
    """Both ranks' gradients at 0.75 of the fp32 maximum: summed first they overflow, pre-divided they do not."""
    plain = run_distributed(reduced_probe_gradient, 2, {}, True)
    scaled = run_distributed(reduced_probe_gradient, 2, extra, True)
    huge = probe_gradients(0, True)
    for p, s in zip(plain, scaled, strict=True):
        n = s["end"] - s["start"]
        assert torch.isinf(p["shard"][:n]).all()
        assert torch.equal(s["shard"][:n], huge[:n])


@pytest.mark.parametrize("extra", [{"prescale_gradients": True}, {"gradient_predivide_factor": 3.0}])
def test_training_with_gradient_scaling_matches_plain_pytorch(extra):
    results = run_distributed(train_on_rank, 2, "mlp", config("mlp", micro_bs=2, extra=extra), 4, 2)
    ref_losses, ref_state, _ = reference_for("mlp", 4, 4)
    assert mean_losses(results) == pytest.approx(ref_losses, rel=1e-5)
    assert_weights_close(results[0]["state"], ref_state)


def test_a_predivide_factor_of_zero_is_refused():
    with pytest.raises(Exception, match="gradient_predivide_factor"):
        load_config({"gradient_predivide_factor": 0})


# -- ignore_unused_parameters ------------------------------------------------------------------------------


def test_unused_parameters_stop_the_step_on_every_rank_when_not_ignored():
    for result in run_distributed(train_with_unused, 2, False, 2):
        assert "unused.weight" in result["error"] and "unused.bias" in result["error"]
        assert "ignore_unused_parameters" in result["error"]


def test_unused_parameters_are_let_through_by_default_and_the_rest_trains_like_plain_pytorch():
    results = run_distributed(train_with_unused, 2, True, 3)
    ref_losses, ref_state, _ = plain_with_unused(3, 4)
    assert mean_losses(results) == pytest.approx(ref_losses, rel=1e-5)
    assert_weights_close(results[0]["state"], ref_state)  # the unused layer too: no step leaves it decayed
    assert any(k.startswith("unused.") for k in ref_state)


# -- seed --------------------------------------------------------------------------------------------------


def test_seed_seeds_python_numpy_and_torch_at_initialize():
    import random

    import numpy as np

    result = run_distributed(draws_after_initialize, 1, 7)[0]
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    assert result["draws"]["random"] == random.random()
    assert result["draws"]["numpy"] == float(np.random.rand())
    assert torch.equal(result["draws"]["torch"], torch.rand(3))


def test_without_seed_initialize_leaves_the_generators_alone():
    result = run_distributed(draws_after_initialize, 1, None)[0]
    random_state, numpy_keys, torch_state = result["before"]
    import random

    import numpy as np

    random.setstate(random_state)
    np.random.set_state(("MT19937", numpy_keys, 624, 0, 0.0))
    torch.set_rng_state(torch_state)
    assert result["draws"]["random"] == random.random()
    assert torch.equal(result["draws"]["torch"], torch.rand(3))


def test_seed_makes_a_meta_models_initial_weights_reproducible():
    a, b, c = (run_distributed(meta_mlp_initial_weights, 1, seed)[0] for seed in (5, 5, 6))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a if k.endswith("weight"))


# -- wall_clock_breakdown ----------------------------------------------------------------------------------


def test_wall_clock_breakdown_prints_each_steps_split_every_steps_per_print():
    result = run_distributed(timed_steps, 1, 4, True)[0]
    lines = [line for line in result["stdout"].splitlines() if "time (ms)" in line]
    assert [line.split()[2] for line in lines] == ["2", "4"]
    assert all("forward:" in line and "backward:" in line and "step:" in line for line in lines)
    assert set(result["last"]) == {"forward", "backward", "step"}
    assert all(v > 0 for v in result["last"].values()) and sum(result["last"].values()) <= result["elapsed"]


def test_without_wall_clock_breakdown_nothing_is_timed_or_printed():
    result = run_distributed(timed_steps, 1, 4, False)[0]
    assert "time (ms)" not in result["stdout"] and result["last"] == {}


def test_steps_per_print_logs_the_step_its_learning_rates_and_gradient_norm_every_that_many_steps():
    result = run_distributed(timed_steps, 1, 4, False)[0]
    lines = [line for line in result["stdout"].splitlines() if line.startswith("infinity: step")]
    assert [line.split()[2] for line in lines] == ["2", "4"]
    last = lines[-1]
    assert "| skipped 0 |" in last
    assert f"lr [{', '.join(f'{lr:.4e}' for lr in result['lr'])}]" in last
    assert result["norm"] is not None and result["norm"] > 0  # the config clips at 1.0: the norm is taken
    assert last.endswith(f"grad norm {result['norm']:.4e}")


# -- stage3_gather_16bit_weights_on_model_save --------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_save_writes_the_consolidated_16bit_weights_when_asked(tmp_path, dtype):
    from safetensors.torch import load_file

    results = run_distributed(save_16bit, 2, str(tmp_path), True, dtype)
    state = results[0]["state"]
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    assert all(r["saved"] for r in results)
    from_checkpoint = torch.load(f"{results[0]['folder']}/pytorch_model.bin")  # written by save_checkpoint
    from_call = load_file(tmp_path / "out" / "model.safetensors")  # written by save_16bit_model
    for saved in (from_checkpoint, from_call):
        assert set(saved) == set(state)
        for key, value in state.items():
            assert saved[key].dtype == compute and torch.equal(saved[key], value.to(compute)), key


def test_a_16bit_model_that_fills_the_disk_is_named_and_leaves_no_partial_file(tmp_path):
    """A checkpoint with `stage3_gather_16bit_weights_on_model_save` on a disk with room for it but not for the
    16-bit file: the error named no path ("No space left on device; free space there"), and the partial file
    stayed inside the published checkpoint for good."""
    import errno

    from storage_fixtures import mounted

    cfg = config("gpt", micro_bs=2, extra_zero={"stage3_gather_16bit_weights_on_model_save": True})
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=cfg)
    probe = engine.save_checkpoint(str(tmp_path / "probe"))
    size = sum(p.stat().st_size for p in Path(probe).iterdir() if p.name != "pytorch_model.bin")
    with mounted(tmp_path / "small_disk", "-t", "tmpfs", "-o", f"size={(size + 65536) // 4096 * 4096}", "none") as disk:
        written = r"cannot write the 16-bit model '.*pytorch_model\.bin': No space left on device \(\d+ bytes free"
        with pytest.raises(OSError, match=written) as info:
            engine.save_checkpoint(str(disk))
        assert info.value.errno == errno.ENOSPC
        folder = disk / (disk / "latest").read_text()
        assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []
        verify_checkpoint(folder)  # the checkpoint itself was published whole
    engine.close()


def test_at_stage_2_save_16bit_model_writes_the_weights_without_the_stage3_key(tmp_path):
    """As DeepSpeed's: the key gates stage 3's gather only; at stages 1-2 every rank holds the weights whole."""
    from safetensors.torch import load_file

    results = run_distributed(save_16bit, 2, str(tmp_path), False, "bf16", 2)
    assert all(r["saved"] for r in results) and not any(r["stderr"] for r in results)
    saved = load_file(tmp_path / "out" / "model.safetensors")
    state = results[0]["state"]
    assert set(saved) == set(state)
    for key, value in state.items():
        assert saved[key].dtype == torch.bfloat16 and torch.equal(saved[key], value.to(torch.bfloat16)), key
    assert not list(tmp_path.glob("ck/*/pytorch_model.bin"))  # save_checkpoint writes it only when asked


def test_without_the_key_no_16bit_file_is_written_and_the_call_says_why(tmp_path):
    results = run_distributed(save_16bit, 2, str(tmp_path), False, "bf16")
    assert not any(r["saved"] for r in results)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob("ck/*/pytorch_model.bin"))
    assert "stage3_gather_16bit_weights_on_model_save" in results[0]["stderr"] and results[1]["stderr"] == ""


# -- keys that have no effect: a notice each --------------------------------------------------------------


def _non_default(key: str) -> dict:
    default = InfinityConfig()
    value = default
    for part in key.split("."):
        value = getattr(value, part)
    new = not value if isinstance(value, bool) else 0.5 if isinstance(value, float) else "Fail"
    cfg: dict = {}
    node = cfg
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = new
    return cfg


@pytest.mark.parametrize("key", list(NO_EFFECT))
def test_a_key_without_effect_set_away_from_its_default_gets_one_notice(key):
    extra = _non_default(key)
    zero = extra.pop("zero_optimization", {})
    cfg = config("mlp", extra=extra, extra_zero=zero)
    notices = no_effect_notices(load_config(cfg))
    assert len(notices) == 1 and f"'{key}'" in notices[0] and "no effect" in notices[0]
    printed = initialize_and_capture(cfg)["stderr"]
    assert printed.count(f"'{key}'") == 1, printed


@pytest.mark.parametrize("stage,noticed", [(3, True), (2, False)])
def test_allgather_bucket_size_is_noticed_as_without_effect_at_stage_3_only(stage, noticed):
    cfg = config("mlp", extra_zero={"stage": stage, "allgather_bucket_size": 1000})
    notices = no_effect_notices(load_config(cfg))
    assert [("allgather_bucket_size" in n and "stage 3" in n) for n in notices] == ([True] if noticed else [])


def test_the_notices_are_printed_by_rank_0_only_and_not_for_defaults():
    cfg = config("mlp", extra={"zero_allow_untested_optimizer": True})
    rank0, rank1 = run_distributed(initialize_and_capture, 2, cfg)
    assert "zero_allow_untested_optimizer" in rank0["stderr"] and rank1["stderr"] == ""
    assert no_effect_notices(load_config(config("mlp"))) == []
