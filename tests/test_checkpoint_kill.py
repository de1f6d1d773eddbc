"""Checkpoints survive real crashes: SIGKILL mid-training and mid-save, then resume, bit for bit.

The subprocess runs are the default job's code path (`python -m infinity train`, NVMe offload) on the
tiny preset. An uninterrupted run of STEPS steps is the reference; killed runs resume with --resume
and must end with identical fp32 masters, Adam moments, compute-dtype weights and step counts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import config
from toy_models import make_model

import infinity
from infinity.engine import checkpoint as ckpt
from infinity.engine import checkpoint_folder
from infinity.engine.checkpoint import OPTIM_STATES, CheckpointError, CheckpointFiles, resolve_folder

STEPS = 40
SAVE_EVERY = 4
TIMEOUT_S = 120


def _train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "infinity",
        "train",
        "--model",
        "tiny",
        "--steps",
        str(STEPS),
        "--save-dir",
        str(run_dir / "ckpt"),
        "--nvme-path",
        str(run_dir / "nvme"),
        *extra,
    ]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ckpt.PAUSE_ENV}
    return {**env, "OMP_NUM_THREADS": "1", **extra}  # one thread everywhere: the same summation order


def _run(run_dir: Path, *extra: str) -> str:
    done = subprocess.run(_train_cmd(run_dir, *extra), env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _resume(run_dir: Path, *extra: str) -> None:
    """Resume and check that it did: it trains only the steps after the checkpoint `latest` names."""
    step = int(_latest(run_dir).removeprefix("global_step"))
    out = _run(run_dir, "--resume", *extra)
    assert f"at step {step}" in out and f"steps {step + 1}-{STEPS} in" in out, out


def _kill_when(proc: subprocess.Popen, condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (code {proc.returncode}) before {what}:\n{proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _latest(run_dir: Path) -> str | None:
    latest = run_dir / "ckpt" / "latest"
    return latest.read_text() if latest.is_file() else None


def _assert_identical_training_state(a: Path, b: Path) -> None:
    """Every flat's compute weights, fp32 masters and moments, and every step count, bit for bit."""
    with CheckpointFiles(resolve_folder(a)) as fa, CheckpointFiles(resolve_folder(b)) as fb:
        meta_a, meta_b = fa.reader("model", 0).obj, fb.reader("model", 0).obj
        assert meta_a["global_steps"] == meta_b["global_steps"] == STEPS
        assert meta_a["lr_scheduler"] == meta_b["lr_scheduler"]
        for name, flat in meta_a["flats"].items():
            kinds = ("param", *OPTIM_STATES) if flat["trainable"] else ("param",)
            for kind in kinds:
                va, vb = fa.read_range(kind, name, 0, flat["numel"]), fb.read_range(kind, name, 0, flat["numel"])
                assert torch.equal(va, vb), f"{kind} of {name} differs"
            if flat["trainable"]:
                assert (
                    fa.reader("optim", 0).obj["shards"][name]["step"]
                    == fb.reader("optim", 0).obj["shards"][name]["step"]
                )


class _Reference:
    """The uninterrupted run, started in the background so that it overlaps the first killed run."""

    def __init__(self, run_dir: Path) -> None:
        self.ckpt = run_dir / "ckpt"
        cmd = _train_cmd(run_dir)
        self._proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def done(self) -> Path:
        out, _ = self._proc.communicate(timeout=TIMEOUT_S)
        assert self._proc.returncode == 0, out
        return self.ckpt


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    reference = _Reference(tmp_path_factory.mktemp("uninterrupted"))
    yield reference
    reference.done()


def test_sigkill_mid_training_then_resume_equals_uninterrupted_run(tmp_path, uninterrupted):
    proc = subprocess.Popen(
        _train_cmd(tmp_path, "--save-every", str(SAVE_EVERY)),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _kill_when(proc, lambda: _latest(tmp_path) is not None, "the first checkpoint")
    killed_at = _latest(tmp_path)
    assert killed_at != f"global_step{STEPS}", "the run finished before it could be killed"
    _resume(tmp_path, "--save-every", str(SAVE_EVERY))
    _assert_identical_training_state(uninterrupted.done(), tmp_path / "ckpt")


def test_sigkill_during_a_save_keeps_the_previous_checkpoint_and_resume_is_exact(tmp_path, uninterrupted):
    proc = subprocess.Popen(
        _train_cmd(tmp_path, "--save-every", str(SAVE_EVERY)),
        env=_env(**{ckpt.PAUSE_ENV: "0.5"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    second = tmp_path / "ckpt" / f".global_step{2 * SAVE_EVERY}.tmp"
    _kill_when(proc, lambda: (second / ckpt.model_file(0)).is_file(), "the second save to start")
    assert _latest(tmp_path) == f"global_step{SAVE_EVERY}"
    assert not (tmp_path / "ckpt" / f"global_step{2 * SAVE_EVERY}").exists()
    _resume(tmp_path)
    _assert_identical_training_state(uninterrupted.done(), tmp_path / "ckpt")


# -- crashes inside the publication steps, simulated in-process -------------------------------------------


def _engine():
    cfg = config("mlp_h40", micro_bs=2, persistence=64)
    engine, _, _, _ = infinity.initialize(model=make_model("mlp_h40"), config=cfg)
    return engine


class _Crash(Exception):
    pass


def test_crash_between_the_renames_of_a_resaved_tag_leaves_it_loadable(tmp_path, monkeypatch):
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="best")
    before = engine.full_state_dict()
    real_replace = os.replace
    calls = []

    def replace_then_crash(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the old folder is moved aside; the crash comes before the new one is in place
            raise _Crash
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace_then_crash)
    with pytest.raises(_Crash):
        engine.save_checkpoint(str(tmp_path), tag="best")
    monkeypatch.undo()
    assert not (tmp_path / "best").exists() and (tmp_path / ".best.old").is_dir()
    fresh = _engine()
    folder, _ = fresh.load_checkpoint(str(tmp_path))
    assert Path(folder).name == ".best.old"
    after = fresh.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_crash_before_latest_is_rewritten_leaves_the_previous_checkpoint_current(tmp_path, monkeypatch):
    engine = _engine()
    engine.save_checkpoint(str(tmp_path), tag="first")
    real_write = checkpoint_folder.write_text

    def crash_on_latest(path, text):
        if path.name == ".latest.tmp":
            raise _Crash
        real_write(path, text)

    monkeypatch.setattr(checkpoint_folder, "write_text", crash_on_latest)
    with pytest.raises(_Crash):
        engine.save_checkpoint(str(tmp_path), tag="second")
    monkeypatch.undo()
    assert (tmp_path / "latest").read_text() == "first"
    folder, _ = _engine().load_checkpoint(str(tmp_path))
    assert Path(folder).name == "first"


def test_a_stale_staging_folder_is_ignored_and_replaced(tmp_path):
    engine = _engine()
    stale = tmp_path / ".global_step0.tmp"
    stale.mkdir(parents=True)
    (stale / ckpt.model_file(0)).write_bytes(b"half a file")
    engine.save_checkpoint(str(tmp_path))
    assert not stale.exists()
    _engine().load_checkpoint(str(tmp_path))


# -- damaged files ------------------------------------------------------------------------------------------


def test_corrupted_manifest_is_named(tmp_path):
    folder = Path(_engine().save_checkpoint(str(tmp_path)))
    (folder / ckpt.MANIFEST.format(rank=0)).write_text('{"world_size": 1, "files": {')
    with pytest.raises(CheckpointError, match=r"manifest_rank0\.json' is corrupted"):
        _engine().load_checkpoint(str(tmp_path))


def test_truncated_file_is_named_by_the_consolidator_too(tmp_path):
    from infinity.engine.consolidate import consolidate

    folder = Path(_engine().save_checkpoint(str(tmp_path)))
    victim = folder / ckpt.model_file(0)
    victim.write_bytes(victim.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=f"{victim.name}.*truncated"):
        consolidate(tmp_path, tmp_path / "out.pt")


def test_latest_naming_a_missing_folder_is_an_error(tmp_path):
    _engine().save_checkpoint(str(tmp_path))
    (tmp_path / "latest").write_text("global_step99")
    with pytest.raises(CheckpointError, match=r"global_step99' does not exist"):
        _engine().load_checkpoint(str(tmp_path))
