"""What a user already has on disk survives their mistakes: a fresh run pointed at an earlier run's checkpoints,
a consolidated file or a Hugging Face folder written over a checkpoint or another folder, a tag that is not a
plain name, a checkpoint from a newer infinity. Each is refused before anything is written, naming the path."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from harness import config, train_steps
from toy_models import batches, make_model

import infinity
from infinity.cli import main
from infinity.cli.faults import ExitCode
from infinity.config import ConfigError
from infinity.engine.checkpoint import MANIFEST, CheckpointError
from infinity.engine.checkpoint_folder import seal_manifest
from infinity.engine.consolidate import consolidate
from infinity.models.hf import check_hf_output

TINY = ["train", "--model", "tiny", "--offload", "cpu", "--seq", "16"]


def _fingerprint(folder: Path) -> dict[str, str]:
    """Every file under `folder` and its SHA-256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A save dir with the tiny preset's checkpoints global_step2 and global_step4 (latest)."""
    root = tmp_path_factory.mktemp("kept")
    assert main([*TINY, "--steps", "4", "--save-every", "2", "--save-dir", str(root / "ck")]) == 0
    return root / "ck"


def test_a_fresh_run_into_a_save_dir_with_checkpoints_is_refused_and_they_are_kept(saved, capsys):
    before = _fingerprint(saved)
    assert main([*TINY, "--steps", "2", "--save-dir", str(saved)]) == 2
    err = capsys.readouterr().err
    assert f"--save-dir '{saved}' holds checkpoints of an earlier run (global_step2, global_step4)" in err
    assert "add --resume" in err
    assert _fingerprint(saved) == before


def test_consolidating_into_a_checkpoint_is_refused_and_it_still_verifies(saved, tmp_path):
    before = _fingerprint(saved)
    inside = saved / "global_step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    for out in (inside, saved / "global_step2" / "new.pt", saved / "latest"):
        with pytest.raises(CheckpointError, match="checkpoint"):
            consolidate(saved, out)
    assert _fingerprint(saved) == before
    consolidate(saved, tmp_path / "model.pt")  # beside it, not inside: written
    assert (tmp_path / "model.pt").stat().st_size > 0


def test_consolidate_does_not_replace_an_existing_file_unless_told_to(saved, tmp_path, capsys):
    """The output may be a user's own weights or notes: refused in one line (exit 3), kept byte for byte;
    `--overwrite` replaces it with the consolidated weights."""
    mine = tmp_path / "model.safetensors"
    mine.write_bytes(b"a user's own weights")
    assert main(["consolidate", str(saved), str(mine)]) == ExitCode.PATH
    err = capsys.readouterr().err
    assert f"the output '{mine}' exists; name a new file, or pass --overwrite" in err and err.count("\n") == 1
    assert mine.read_bytes() == b"a user's own weights"
    assert main(["consolidate", str(saved), str(mine), "--overwrite"]) == 0
    assert mine.stat().st_size > 1000 and not list(tmp_path.glob(".*partial"))


def _engine() -> infinity.InfinityEngine:
    engine, _, _, _ = infinity.initialize(model=make_model("gpt"), config=config(micro_bs=2))
    train_steps(engine, batches("gpt", 2), 1)
    return engine


@pytest.mark.parametrize("tag", ["latest", ".", "..", "a/b", "../escaped", ".hidden", "best ", " best", "best\n"])
def test_a_tag_that_is_not_a_plain_folder_name_is_refused_before_anything_is_written(tmp_path, tag):
    engine = _engine()
    try:
        with pytest.raises(CheckpointError, match="is not a plain folder name"):
            engine.save_checkpoint(str(tmp_path / "ck"), tag=tag)
    finally:
        engine.close()
    assert not (tmp_path / "ck").exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_tag_naming_a_folder_that_is_not_a_checkpoint_is_refused_and_the_folder_kept(tmp_path):
    mine = tmp_path / "ck" / "best"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    engine = _engine()
    try:
        with pytest.raises(CheckpointError, match="exists and is not a checkpoint"):
            engine.save_checkpoint(str(tmp_path / "ck"), tag="best")
        engine.save_checkpoint(str(tmp_path / "ck"), tag="global_step1")  # a checkpoint beside it is fine
        engine.save_checkpoint(str(tmp_path / "ck"), tag="global_step1")  # and re-saving a checkpoint's tag
    finally:
        engine.close()
    assert (mine / "notes.txt").read_text() == "mine"


def test_a_checkpoint_from_a_newer_format_is_refused_by_name(tmp_path):
    engine = _engine()
    folder = Path(engine.save_checkpoint(str(tmp_path / "ck")))
    manifest = folder / MANIFEST.format(rank=0)
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(seal_manifest({**data, "format_version": 99})))  # as a newer infinity writes
    try:
        with pytest.raises(CheckpointError, match="format 99, written by a newer infinity"):
            engine.load_checkpoint(str(tmp_path / "ck"))
        manifest.write_text(json.dumps(seal_manifest({**data, "global_steps": None})))
        with pytest.raises(CheckpointError, match="'global_steps' is None"):
            engine.load_checkpoint(str(tmp_path / "ck"))
    finally:
        engine.close()


def _hf_like(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        (folder / name).write_text("{}")
    return folder


def test_the_hugging_face_output_replaces_only_a_new_empty_or_hugging_face_folder(tmp_path):
    model, save_dir = _hf_like(tmp_path / "model"), tmp_path / "runs"
    check_hf_output(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_hf_output(tmp_path / "empty")
    check_hf_output(_hf_like(tmp_path / "earlier"), keep=(model, save_dir))
    refused = {
        model: "is, holds or is inside",  # the source model itself
        save_dir / "hf": "is, holds or is inside",  # inside the checkpoints
        tmp_path: "is, holds or is inside",  # holding the model
    }
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    refused[mine] = "not a Hugging Face model folder (it holds notes.txt)"
    (tmp_path / "a_file").write_text("x")
    refused[tmp_path / "a_file"] = "is a file"
    for out, why in refused.items():
        with pytest.raises(ConfigError, match=re.escape(why)):
            check_hf_output(out, keep=(model, save_dir))
    assert (mine / "notes.txt").read_text() == "mine"


def test_resuming_another_models_checkpoints_names_the_mismatch_and_offers_none_of_them(saved, capsys):
    before = _fingerprint(saved)
    args = ["train", "--model", "small", "--offload", "cpu", "--seq", "16", "--steps", "6", "--save-dir", str(saved)]
    assert main([*args, "--resume"]) == ExitCode.CHECKPOINT
    err = capsys.readouterr().err
    assert "holds a different model" in err and "infinity consolidate" in err and "--resume-tag" not in err
    assert "--model sizes the model, and --seq a GPT preset's position table" in err
    assert _fingerprint(saved) == before


def test_an_incomplete_latest_is_named_as_incomplete_with_the_checkpoints_there(saved, tmp_path, capsys):
    import shutil

    copy = Path(shutil.copytree(saved, tmp_path / "ck"))
    (copy / "global_step4" / MANIFEST.format(rank=0)).unlink()
    assert main(["consolidate", str(copy), str(tmp_path / "out.pt")]) == ExitCode.CHECKPOINT
    err = capsys.readouterr().err
    assert f"checkpoint '{copy / 'global_step4'}' has no manifest_rank0.json: it is incomplete" in err
    assert "checkpoints there: global_step2; name one with --tag TAG" in err


def test_a_save_dir_under_a_file_is_named_as_such(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main([*TINY, "--steps", "1", "--save-dir", str(tmp_path / "afile" / "x")]) == ExitCode.PATH
    assert f"its existing parent '{tmp_path / 'afile'}' is a file, not a folder" in capsys.readouterr().err


def _hold_lock_in_another_process(folder: Path):
    """A live process holding `folder`'s writer lock, as another run saving there does; stop it to release."""
    import subprocess
    import sys

    code = (
        "import sys, time\nfrom pathlib import Path\nfrom infinity.engine.save_dir_lock import hold_save_dir\n"
        "hold_save_dir(Path(sys.argv[1]), 'other run')\nprint('held', flush=True)\ntime.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_live_run_saving_into_the_same_folder_is_refused_and_the_first_keeps_its_checkpoints(
    tmp_path, capsys
):
    """Two runs sharing a --save-dir both exited 0 while one silently replaced the other's checkpoints (or, started
    together, deleted each other's staging folders). The folder's writer lock refuses the second run before it
    trains, naming the live one; once that run ends, the folder is free again."""
    ck = tmp_path / "ck"
    ck.mkdir()
    holder = _hold_lock_in_another_process(ck)
    try:
        assert main([*TINY, "--steps", "2", "--save-dir", str(ck)]) == ExitCode.CHECKPOINT
        err = capsys.readouterr().err
        assert f"save folder of another live run (pid {holder.pid})" in err and "--save-dir" in err
        assert list(ck.iterdir()) == []  # nothing written
        engine = _engine()  # the Python API: refused at the save, nothing staged
        try:
            with pytest.raises(CheckpointError, match=f"another live run \\(pid {holder.pid}\\)"):
                engine.save_checkpoint(str(ck))
        finally:
            engine.close()
        assert list(ck.iterdir()) == []
    finally:
        holder.kill()
        holder.wait()
    assert main([*TINY, "--steps", "2", "--save-dir", str(ck)]) == 0  # the kernel dropped the dead run's lock
    assert (ck / "latest").read_text().strip() == "global_step2"


def test_the_save_folder_lock_ends_with_the_run_not_with_its_forked_workers_nor_a_failed_start(tmp_path):
    """A forked child (a DataLoader worker) shared the lock, so it outlived the run that took it; an in-process
    `infinity train` that failed before its engine existed kept it until the process exited."""
    import os
    import signal

    from infinity.engine.save_dir_lock import hold_save_dir, release_save_dirs

    ck = tmp_path / "ck"
    hold_save_dir(ck, "test")
    child = os.fork()
    if child == 0:  # a worker that lives on
        signal.pause()
        os._exit(0)
    try:
        release_save_dirs("test")
        holder = _hold_lock_in_another_process(ck)  # taken by another run while the worker lives
        holder.kill()
        holder.wait()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    (tmp_path / "a_file").write_text("")
    bad = [*TINY, "--steps", "1", "--save-dir", str(ck), "--nvme-path", str(tmp_path / "a_file")]
    assert main([*bad, "--offload", "nvme"]) == ExitCode.PATH  # refused after the lock was taken
    holder = _hold_lock_in_another_process(ck)  # ...and let go
    holder.kill()
    holder.wait()


def test_a_new_save_folder_is_locked_before_training_not_at_the_first_save(tmp_path, capsys):
    """Two runs started together on a folder that did not exist: the second trained to the end and was refused
    at its only save, losing the run."""
    ck = tmp_path / "fresh"
    holder = _hold_lock_in_another_process(ck)
    try:
        assert main([*TINY, "--steps", "2", "--save-dir", str(ck)]) == ExitCode.CHECKPOINT
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err
    assert "another live run" in err and "step" not in capsys.readouterr().out
