"""The `infinity` command: the default job end to end, config printing, overrides, errors, torchrun, progress."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist import run_distributed

from infinity.cli import main
from infinity.cli.faults import ExitCode
from infinity.cli.progress import Progress, format_rates
from infinity.engine.checkpoint import MANIFEST, model_file, optim_file


def _python_m_infinity(args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run(
        [sys.executable, "-m", "infinity", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_default_job_trains_the_small_gpt_with_nvme_offload_and_writes_a_checkpoint(tmp_path):
    done = _python_m_infinity(["train", "--steps", "10"], cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "GPT 'small'" in out and "params on nvme, optimizer on nvme" in out
    assert (tmp_path / "nvme").is_dir()  # the default NVMe folder, under the working directory
    # Not a TTY: plain progress lines with step, loss, tokens/s and the swap rate of each tier pair
    # (parameters and optimizer state read from NVMe into host memory, the CPU compute's own).
    assert re.search(r"step 10/10  loss \d+\.\d+  lr \S+  [\d,]+ tokens/s  swap: .*nvme->host \S+ GB/s", out), out
    first_k, last_k = map(float, re.search(r"mean of first \d+ steps ([\d.]+), last \d+ ([\d.]+)", out).groups())
    assert last_k < first_k - 0.5, out  # bytes start at ln(256) = 5.5 nats
    folder = tmp_path / "runs" / "default" / "global_step10"
    assert f"checkpoint written to {Path('runs/default/global_step10')}" in out
    assert (folder / model_file(0)).is_file() and (folder / optim_file(0)).is_file()
    assert (folder / MANIFEST.format(rank=0)).is_file()
    assert (tmp_path / "runs" / "default" / "latest").read_text() == "global_step10"


def test_config_command_prints_the_default_job_config_resolved(capsys):
    assert main(["config", "--steps", "50"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["scheduler"]["params"]["total_num_steps"] == 50  # "auto", from --steps
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 5
    assert cfg["zero_optimization"]["offload_param"] == {
        "device": "nvme",
        "nvme_path": "./nvme",
        "pin_memory": False,
        "buffer_count": 5,
        "buffer_size": 100_000_000,
        "max_in_cpu": 1_000_000_000,
    }
    assert cfg["train_batch_size"] == 8 and cfg["optimizer"]["params"]["eps"] == 1e-8


def test_config_command_resolves_a_files_auto_values_and_batch_arithmetic(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
                "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
            }
        )
    )
    assert main(["config", str(path), "--world-size", "4", "--model", "tiny", "--offload", "cpu"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert cfg["train_batch_size"] == 32
    assert cfg["optimizer"]["params"]["lr"] == 3e-3
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 32 * 32  # tiny: hidden 32
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["aio"]["queue_depth"] == 16  # every default is filled in


def test_config_command_reports_a_mistake_and_exits_2(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimisation": {"stage": 3}}))
    assert main(["config", str(path)]) == 2
    assert "did you mean 'zero_optimization'" in capsys.readouterr().err


def test_train_with_a_deepspeed_config_file_and_overrides(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": 2,
                "steps_per_print": 1,
                "gradient_clipping": "auto",
                "bf16": {"enabled": "auto"},
                "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": "auto"}},
                "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
            }
        )
    )
    args = ["train", "--config", str(path), "--model", "tiny", "--steps", "3", "--save-dir", str(tmp_path / "ck")]
    assert main([*args, "--offload", "cpu", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "batch 16" in out and "bfloat16" in out and "params on cpu, optimizer on cpu" in out
    # steps_per_print paces the CLI's own progress lines; the engine's step log stays off (one line a step)
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1/3", "2/3", "3/3"]
    assert "infinity: step" not in out
    assert (tmp_path / "ck" / "latest").read_text() == "global_step3"


def test_nvme_offload_without_a_path_asks_for_nvme_path(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}))
    assert main(["train", "--config", str(path), "--model", "tiny", "--steps", "1"]) == 2
    assert "--nvme-path" in capsys.readouterr().err


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, capsys):
    args = ["train", "--model", "tiny", "--steps", "2", "--offload", "cpu", "--save-dir", str(tmp_path), "--resume"]
    assert main(args) == ExitCode.CHECKPOINT
    err = capsys.readouterr().err
    assert "cannot resume" in err and "no checkpoint there is complete" in err and "without --resume" in err


def test_an_empty_resume_tag_is_refused_not_taken_for_no_resume(tmp_path, capsys):
    args = ["train", "--model", "tiny", "--steps", "2", "--offload", "cpu", "--save-dir", str(tmp_path)]
    assert main([*args, "--resume-tag", ""]) == ExitCode.USAGE
    assert "--resume-tag needs the tag of a checkpoint" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing saved


def test_resume_continues_to_the_total_step_count(tmp_path, capsys):
    base = ["train", "--model", "tiny", "--offload", "cpu", "--save-dir", str(tmp_path)]
    assert main([*base, "--steps", "3"]) == 0
    assert main([*base, "--steps", "5", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "at step 3" in out and "steps 4-5 in" in out
    assert (tmp_path / "latest").read_text() == "global_step5"
    assert "not applied on resume" not in out
    # the checkpoint's schedule wins over a new --lr (as in DeepSpeed): said, not silently dropped
    assert main([*base, "--steps", "6", "--resume", "--lr", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "--lr 0.5 is not applied on resume: the checkpoint's schedule continues (peak lr 0.003)" in out


def test_consolidate_command_writes_a_loadable_state_dict(tmp_path, capsys):
    assert main(["train", "--model", "tiny", "--offload", "cpu", "--steps", "2", "--save-dir", str(tmp_path)]) == 0
    assert main(["consolidate", str(tmp_path), str(tmp_path / "model.pt")]) == 0
    assert "wrote" in capsys.readouterr().out
    from infinity.models.gpt import GPT, gpt_preset

    GPT(gpt_preset("tiny")).load_state_dict(torch.load(tmp_path / "model.pt"))
    assert main(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "x.pt")]) == ExitCode.CHECKPOINT


def train_on_this_rank(save_dir: str) -> tuple[int, str]:
    """`infinity train` on one rank of a torchrun-style launch (rank and rendezvous from the environment)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", "--model", "tiny", "--steps", "3", "--offload", "cpu", "--save-dir", save_dir])
    return code, out.getvalue()


def test_under_torchrun_every_rank_trains_and_rank_0_prints(tmp_path):
    # run_distributed starts ranks with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) and no
    # process group, so the engine joins one exactly as it does under torchrun.
    results = run_distributed(train_on_this_rank, 2, str(tmp_path / "ck"), init_process_group=False)
    (code0, out0), (code1, out1) = results
    assert code0 == code1 == 0
    assert "infinity: GPT 'tiny'" in out0 and "2 rank(s)" in out0 and out1 == ""
    folder = tmp_path / "ck" / "global_step3"
    assert all((folder / model_file(r)).is_file() and (folder / optim_file(r)).is_file() for r in range(2))


# -- the progress display ----------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_tty_redraws_one_line_and_ends_it():
    stream = _Tty()
    bar = Progress(3, tokens_per_step=100, stream=stream, min_interval_s=0.0)
    for step in (1, 2, 3):
        bar.update(step, 2.0 / step, {"host->device": 1000 * step})
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "step 3/3  loss 0.6667" in text


def test_progress_off_a_tty_prints_every_n_steps_and_the_last():
    stream = io.StringIO()
    bar = Progress(7, tokens_per_step=100, stream=stream, print_every=3)
    for step in range(1, 8):
        bar.update(step, 1.0, {})
    lines = stream.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["3/7", "6/7", "7/7"]
    assert all("\r" not in line and "swap: no swap" in line for line in lines)


def test_swap_rates_are_byte_deltas_over_time_per_tier_pair():
    now = {"host->device": 3_000_000_000, "nvme->host": 500_000_000}
    before = {"host->device": 1_000_000_000, "nvme->host": 500_000_000}
    assert format_rates(now, before, seconds=2.0) == "host->device 1 GB/s"


def test_infinitys_own_warnings_print_as_one_note_line_and_others_as_python_prints_them(capsys):
    """A stale swap file's removal printed as ".../storage/mover.py:59: UserWarning: ..." in a run's output."""
    import warnings

    import infinity
    from infinity.cli import _notices_as_lines

    ours = str(Path(infinity.__file__).parent / "storage" / "mover.py")
    with pytest.warns(UserWarning, match="from elsewhere") as others, _notices_as_lines("train"):
        warnings.warn_explicit("removing stale swap file 'x.swap'", UserWarning, ours, 59)
        warnings.warn_explicit("from elsewhere", UserWarning, "/somewhere/else.py", 3)
    err = capsys.readouterr().err
    assert "infinity train: note: removing stale swap file 'x.swap'\n" in err and "mover.py:59" not in err
    assert "note: from elsewhere" not in err and [str(w.message) for w in others] == ["from elsewhere"]


def test_a_run_whose_loss_turns_nan_stops_and_latest_keeps_the_last_finite_checkpoint(tmp_path, capsys):
    """--lr 1e10 trained on to a nan loss, exited 0 and saved the nan weights as `latest`."""
    args = ["train", "--model", "tiny", "--offload", "cpu", "--steps", "20", "--save-every", "1", "--lr", "1e10"]
    assert main([*args, "--save-dir", str(tmp_path)]) == ExitCode.USAGE
    err = capsys.readouterr().err
    step = int(re.search(r"the loss is nan at step (\d+): training diverged", err).group(1))
    assert (tmp_path / "latest").read_text() == f"global_step{step - 1}"
    assert not (tmp_path / f"global_step{step}").exists()


def test_a_finite_loss_with_a_nan_gradient_norm_stops_before_its_weights_are_saved():
    """The loss is taken before the step's update: a nan gradient (a norm at zero, a bf16 overflow) wrote nan
    weights that the step's save kept as `latest`, exit 0. The clipped norm, the same on every rank, says so."""
    from types import SimpleNamespace

    from infinity.cli.train import _stop_if_diverged
    from infinity.config import ConfigError

    def engine(norm, dtype=torch.float32):
        return SimpleNamespace(get_global_grad_norm=lambda: norm, compute_dtype=dtype)

    for norm in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=f"the gradient norm is {norm} at step 3: training diverged"):
            _stop_if_diverged(engine(norm), 2.5, 3)
    with pytest.raises(ConfigError, match="the loss is nan at step 3.*start again with a lower --lr"):
        _stop_if_diverged(engine(None, torch.bfloat16), float("nan"), 3)
    _stop_if_diverged(engine(1.0), 2.5, 3)  # finite: trains on
    _stop_if_diverged(engine(None), 2.5, 3)  # no norm taken (clipping off): the loss alone
    _stop_if_diverged(engine(float("inf"), torch.float16), 2.5, 3)  # fp16 skips the overflowing step


def test_lr_overrides_a_config_files_learning_rate_and_its_schedules_peak(tmp_path):
    """--lr with --config filled only an "auto" lr: a number in the file won, silently (the help calls --lr the
    peak learning rate, and --offload, --dtype override the file)."""
    from infinity.cli import _parser
    from infinity.cli.train import build_config

    path = tmp_path / "ds.json"
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 10}}
    path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "scheduler": scheduler}))
    base = ["train", "--config", str(path), "--model", "tiny"]
    cfg = build_config(_parser().parse_args([*base, "--lr", "0.02"]), 32)
    assert cfg.optimizer.params["lr"] == 0.02 and cfg.scheduler.params["warmup_max_lr"] == 0.02
    cfg = build_config(_parser().parse_args(base), 32)  # without the flag the file's values stand
    assert cfg.optimizer.params["lr"] == 3e-4 and cfg.scheduler.params["warmup_max_lr"] == 3e-4
