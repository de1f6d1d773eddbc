"""Faults end in one clear line: each user error of issue 12, run through the real `infinity` command in a
subprocess, exits with its class's code and one line on stderr naming the cause; and a save that a full
disk or a signal stops leaves no partial checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_signals import default_signal_actions

from infinity.cli.faults import ExitCode
from infinity.engine.checkpoint import LATEST, MANIFEST, model_file, optim_file, verify_checkpoint
from infinity.engine.checkpoint_folder import seal_manifest

pytest_plugins = ["storage_fixtures"]  # real directories: read-only bind mounts, tiny tmpfs

TIMEOUT_S = 120
TINY_CPU = ["train", "--model", "tiny", "--offload", "cpu"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("INFINITY_DEBUG", "INFINITY_TEST_PAUSE_IN_SAVE")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _infinity(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "infinity", *args],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _popen(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "infinity", *args],
        cwd=cwd,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_signal_actions,
    )


def _one_line(stderr: str) -> str:
    """The single line of `stderr` (a traceback or a second line fails the test)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def _fails(done: subprocess.CompletedProcess, code: ExitCode, *named: str) -> str:
    assert done.returncode == code, f"exit code {done.returncode}, expected {code!r}\n{done.stdout}\n{done.stderr}"
    line = _one_line(done.stderr)
    for text in named:
        assert text in line, line
    return line


def _wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if proc.poll() is not None:
            out = proc.stdout.read() + proc.stderr.read()
            pytest.fail(f"the run ended (code {proc.returncode}) before {what}:\n{out}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A save dir with three checkpoints of the tiny preset: global_step2, 4 and 6 (latest)."""
    cwd = tmp_path_factory.mktemp("saved")
    done = _infinity([*TINY_CPU, "--steps", "6", "--save-every", "2", "--save-dir", "ck"], cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return cwd / "ck"


def _copy(saved_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved_run, tmp_path / "ck"))


# -- paths ----------------------------------------------------------------------------------------------------


def test_nvme_path_naming_a_regular_file_is_a_path_error(tmp_path):
    (tmp_path / "swap.txt").write_text("not a folder")
    done = _infinity(["train", "--model", "tiny", "--steps", "1", "--nvme-path", "swap.txt"], tmp_path)
    _fails(done, ExitCode.PATH, "--nvme-path 'swap.txt' is a file, not a folder")
    assert (tmp_path / "swap.txt").read_text() == "not a folder"


def test_read_only_nvme_path_is_a_path_error(tmp_path, read_only_dir):
    done = _infinity(["train", "--model", "tiny", "--steps", "1", "--nvme-path", str(read_only_dir)], tmp_path)
    _fails(done, ExitCode.PATH, f"--nvme-path '{read_only_dir}'", "read-only filesystem", "choose a writable folder")


def test_read_only_save_dir_is_refused_before_training(tmp_path, read_only_dir):
    done = _infinity([*TINY_CPU, "--steps", "1", "--save-dir", str(read_only_dir / "ck")], tmp_path)
    _fails(done, ExitCode.PATH, f"--save-dir '{read_only_dir / 'ck'}'", "read-only filesystem")
    assert "step 1/1" not in done.stdout


def test_second_run_sharing_an_nvme_path_is_refused_and_the_first_cleans_up_on_sigterm(tmp_path):
    on_nvme = ["train", "--model", "tiny", "--nvme-path", "nvme"]
    first = _popen([*on_nvme, "--steps", "100000", "--save-dir", "a"], tmp_path)
    swap = tmp_path / "nvme" / "infinity-rank0.swap"
    try:
        _wait_for(swap.exists, first, "the first run's swap file")
        second = _infinity([*on_nvme, "--steps", "1", "--save-dir", "b"], tmp_path)
        _fails(second, ExitCode.SWAP_FILE, str(Path("nvme") / swap.name), "live run", "its own nvme_path")
        assert first.poll() is None, "the second run disturbed the first"
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=TIMEOUT_S)
    finally:
        first.kill()
    assert first.returncode == 128 + signal.SIGTERM
    assert _one_line(err).endswith("interrupted by SIGTERM")
    assert not swap.exists()


def test_consolidate_to_a_read_only_folder_is_a_path_error(saved_run, tmp_path, read_only_dir):
    done = _infinity(["consolidate", str(saved_run), str(read_only_dir / "model.pt")], tmp_path)
    _fails(done, ExitCode.PATH, f"cannot write '{read_only_dir / 'model.pt'}'", "Read-only file system")


# -- checkpoints ------------------------------------------------------------------------------------------------


def test_manifest_missing_world_size_is_named(saved_run, tmp_path):
    ck = _copy(saved_run, tmp_path)
    manifest = ck / "global_step6" / MANIFEST.format(rank=0)
    data = json.loads(manifest.read_text())
    del data["world_size"]
    manifest.write_text(json.dumps(seal_manifest(data)))  # as a writer that left it out would
    done = _infinity(["consolidate", "ck", "model.pt"], tmp_path)
    _fails(done, ExitCode.CHECKPOINT, f"'{manifest.relative_to(tmp_path)}' is damaged: it has no 'world_size'")
    done = _infinity([*TINY_CPU, "--steps", "8", "--save-dir", "ck", "--resume"], tmp_path)
    _fails(done, ExitCode.CHECKPOINT, "has no 'world_size'", "--resume-tag global_step4")


def test_a_manifest_changed_after_it_was_written_is_named_as_damaged_and_the_newest_good_one_offered(
    saved_run, tmp_path
):
    """One digit of `world_size` changed in a manifest read as a checkpoint of another world size (no fallback
    offered). The manifest's own checksum names it as damaged; --resume offers the newest checkpoint that
    verifies, and --resume-fallback takes it."""
    ck = _copy(saved_run, tmp_path)
    manifest = ck / "global_step6" / MANIFEST.format(rank=0)
    manifest.write_text(manifest.read_text().replace('"world_size": 1', '"world_size": 2', 1))
    resume = [*TINY_CPU, "--steps", "8", "--save-dir", "ck", "--resume"]
    done = _infinity(resume, tmp_path)
    _fails(done, ExitCode.CHECKPOINT, "do not match its own checksum", "--resume-tag global_step4")
    done = _infinity([*resume, "--resume-fallback"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "global_step4" in done.stdout and (ck / LATEST).read_text() == "global_step8"


def test_empty_latest_is_reported_as_empty_and_the_newest_complete_one_offered(saved_run, tmp_path):
    ck = _copy(saved_run, tmp_path)
    (ck / LATEST).write_text("")
    done = _infinity([*TINY_CPU, "--steps", "8", "--save-dir", "ck", "--resume"], tmp_path)
    line = _fails(done, ExitCode.CHECKPOINT, f"'{Path('ck') / LATEST}' is empty", "--resume-tag global_step6")
    assert "manifest" not in line


def test_missing_latest_hint_names_the_resume_tag_flag(saved_run, tmp_path):
    ck = _copy(saved_run, tmp_path)
    (ck / LATEST).unlink()
    done = _infinity([*TINY_CPU, "--steps", "8", "--save-dir", "ck", "--resume"], tmp_path)
    line = _fails(done, ExitCode.CHECKPOINT, "has no 'latest' file", "--resume-tag global_step6")
    assert "tag=" not in line
    done = _infinity(["consolidate", "ck", "model.pt"], tmp_path)
    _fails(done, ExitCode.CHECKPOINT, "has no 'latest' file", "global_step2, global_step4, global_step6", "--tag TAG")


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_resume_from_a_corrupt_latest_offers_then_takes_the_newest_verified_never_a_staging_folder(
    saved_run, tmp_path
):
    ck = _copy(saved_run, tmp_path)
    _corrupt(ck / "global_step6" / optim_file(0))
    # A staging folder of an interrupted later save, complete-looking and valid: never a candidate.
    shutil.copytree(ck / "global_step4", ck / ".global_step8.tmp")
    args = [*TINY_CPU, "--steps", "8", "--save-dir", "ck", "--resume"]
    _fails(
        _infinity(args, tmp_path),
        ExitCode.CHECKPOINT,
        f"{optim_file(0)}' is corrupted",
        "the newest complete checkpoint there is 'global_step4'",
    )
    done = _infinity([*args, "--resume-fallback"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming from the newest complete one, 'global_step4'" in done.stdout
    assert "resumed from ck (global_step4) at step 4" in done.stdout and "steps 5-8 in" in done.stdout
    assert (ck / LATEST).read_text() == "global_step8"
    verify_checkpoint(ck / "global_step8")


def test_resume_tag_picks_a_checkpoint_by_name(saved_run, tmp_path):
    _copy(saved_run, tmp_path)
    done = _infinity([*TINY_CPU, "--steps", "3", "--save-dir", "ck", "--resume-tag", "global_step2"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from ck (global_step2) at step 2" in done.stdout and "steps 3-3 in" in done.stdout
    done = _infinity([*TINY_CPU, "--steps", "3", "--save-dir", "ck", "--resume-tag", "global_step5"], tmp_path)
    _fails(done, ExitCode.CHECKPOINT, "global_step5' does not exist", "--resume-tag global_step6")


# -- config ---------------------------------------------------------------------------------------------------


def test_a_directory_given_as_config_is_named_as_a_directory(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "ds.json").write_text("{}")
    done = _infinity(["train", "--config", "configs"], tmp_path)
    line = _fails(done, ExitCode.USAGE, "config file 'configs' is a directory", "ds.json")
    assert "does not exist" not in line


@pytest.mark.parametrize("command", ["config", "train"])
def test_a_micro_batch_of_1e30_is_refused_naming_the_key(tmp_path, command):
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 1e30}')
    args = ["config", "ds.json"] if command == "config" else [*TINY_CPU, "--config", "ds.json", "--steps", "1"]
    _fails(_infinity(args, tmp_path), ExitCode.USAGE, "'train_micro_batch_size_per_gpu' is 1e+30")


def test_a_null_optimizer_is_refused_naming_the_key(tmp_path):
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": null}')
    done = _infinity([*TINY_CPU, "--config", "ds.json", "--steps", "1"], tmp_path)
    _fails(done, ExitCode.USAGE, "'optimizer' is null", "remove the key", '"type": "AdamW"')


def test_a_host_budget_below_the_cpu_offloaded_states_fails_before_training(tmp_path):
    from infinity.models.gpt import count_params, gpt_preset

    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {
                    "host_budget_bytes": 2_200_000,
                    "offload_param": {"device": "cpu"},
                    "offload_optimizer": {"device": "cpu"},
                },
            }
        )
    )
    done = _infinity(["train", "--model", "small", "--config", "ds.json", "--steps", "1"], tmp_path)
    # fp32 on one rank, weights and Adam state both in host memory: 4 bytes of weight (also the master)
    # and 12 of moments and gradient per parameter.
    need = 16 * count_params(gpt_preset("small", block_size=64))
    _fails(done, ExitCode.USAGE, "'zero_optimization.host_budget_bytes' is 2200000", f"need {need} bytes")
    assert "step" not in done.stdout


# -- flag values and data files ------------------------------------------------------------------------------


def _refused_flag(done: subprocess.CompletedProcess, command: str, flag: str, *named: str) -> str:
    """argparse's refusal of a flag's value: exit code 2, one line naming the flag (no usage block, no traceback)."""
    assert done.returncode == ExitCode.USAGE, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"
    line = _one_line(done.stderr)
    assert line.startswith(f"infinity {command}: error: argument {flag}: "), line
    for text in named:
        assert text in line, line
    return line


@pytest.mark.parametrize(
    "name,content,named",
    [
        ("latin1.txt", "Ce qu'on conçoit bien\n".encode("latin-1") * 20, "byte 0xe7 at offset 12"),
        ("noise.bin", bytes(range(128, 256)) * 8, "byte 0x80 at offset 0"),
    ],
)
def test_data_that_is_not_utf8_is_named_with_the_offset_of_its_first_bad_byte(tmp_path, name, content, named):
    (tmp_path / name).write_bytes(content)
    done = _infinity([*TINY_CPU, "--steps", "1", "--data", name], tmp_path)
    _fails(done, ExitCode.USAGE, f"'{name}' is not UTF-8 text", named, "UTF-8 plain text or JSON lines")
    assert "step" not in done.stdout


def test_data_naming_a_folder_says_it_is_a_folder(tmp_path):
    (tmp_path / "texts").mkdir()
    done = _infinity([*TINY_CPU, "--steps", "1", "--data", "texts"], tmp_path)
    line = _fails(done, ExitCode.USAGE, "'texts' is a folder, not a file")
    assert "does not exist" not in line


@pytest.mark.parametrize("params", ["-5", "nan", "inf", "0", "0.5"])
def test_estimate_refuses_a_parameter_count_that_no_model_has(tmp_path, params):
    done = _infinity(["estimate", f"--params={params}"], tmp_path)
    _fails(done, ExitCode.USAGE, "--params must be a positive finite number of parameters")
    assert done.stdout == ""


@pytest.mark.parametrize("world_size", ["0", "-3"])
def test_config_refuses_a_world_size_below_one(tmp_path, world_size):
    (tmp_path / "ds.json").write_text('{"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2}')
    done = _infinity(["config", "ds.json", "--world-size", world_size], tmp_path)
    _fails(done, ExitCode.USAGE, f"--world-size must be >= 1, got {world_size}")


@pytest.mark.parametrize("command", ["train", "tune"])
@pytest.mark.parametrize(
    "flag,value,named",
    [
        ("--seq", "-3", "must be an integer >= 1, got -3"),
        ("--seq", "0", "must be an integer >= 1, got 0"),
        ("--seed", "99999999999999999999999", "must be an integer in [0, 2**63 - 1]"),
        ("--seed", "-1", "must be an integer in [0, 2**63 - 1]"),
    ],
)
def test_train_and_tune_refuse_a_sequence_length_or_seed_out_of_range(tmp_path, command, flag, value, named):
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2}')
    args = [*TINY_CPU, "--steps", "2"] if command == "train" else ["tune", "--config", "ds.json", "--model", "tiny"]
    done = _infinity([*args, flag, value], tmp_path)
    _refused_flag(done, command, flag, named)
    assert "step" not in done.stdout


def test_tune_refuses_a_sequence_longer_than_the_preset_before_any_trial(tmp_path):
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2}')
    done = _infinity(["tune", "--config", "ds.json", "--model", "tiny", "--seq", "100000"], tmp_path)
    _fails(done, ExitCode.USAGE, "--seq 100000 exceeds the 'tiny' preset's block_size 32")
    assert done.stdout == ""


# -- a save that cannot finish --------------------------------------------------------------------------------


def _checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


def test_disk_full_during_a_save_names_the_file_and_free_space_and_removes_the_partial_checkpoint(
    saved_run, tmp_path
):
    from storage_fixtures import mounted

    room = int(1.5 * _checkpoint_bytes(saved_run / "global_step2")) // 4096 * 4096  # one checkpoint, not two
    with mounted(tmp_path / "small_disk", "-t", "tmpfs", "-o", f"size={room}", "none") as disk:
        done = _infinity([*TINY_CPU, "--steps", "4", "--save-every", "2", "--save-dir", str(disk / "ck")], tmp_path)
        line = _fails(done, ExitCode.DISK_FULL, str(disk / "ck" / ".global_step4.tmp"), "No space left", "free there")
        assert model_file(0) in line or optim_file(0) in line
        assert sorted(p.name for p in (disk / "ck").iterdir()) == ["global_step2", LATEST]
        assert (disk / "ck" / LATEST).read_text() == "global_step2"
        verify_checkpoint(disk / "ck" / "global_step2")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_a_save_leaves_no_partial_checkpoint_and_no_swap_file(tmp_path, signum):
    args = ["train", "--model", "tiny", "--steps", "4", "--save-every", "2", "--save-dir", "ck", "--nvme-path", "nvme"]
    proc = _popen(args, tmp_path, INFINITY_TEST_PAUSE_IN_SAVE="1")
    staging = tmp_path / "ck" / ".global_step4.tmp"
    try:
        _wait_for(lambda: (staging / model_file(0)).is_file(), proc, "the second save to start")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum
    assert _one_line(err).endswith(f"interrupted by {signal.Signals(signum).name}")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["global_step2", LATEST]
    verify_checkpoint(tmp_path / "ck" / "global_step2")
    assert list((tmp_path / "nvme").iterdir()) == []


# -- --debug and internal errors ----------------------------------------------------------------------------


def test_debug_flag_and_environment_variable_add_the_traceback(tmp_path):
    (tmp_path / "ds.json").write_text('{"optimizer": null}')
    for extra_args, env in ((["--debug"], {}), ([], {"INFINITY_DEBUG": "1"})):
        done = _infinity(["config", "ds.json", *extra_args], tmp_path, **env)
        assert done.returncode == ExitCode.USAGE
        assert "Traceback" in done.stderr and "ConfigError" in done.stderr
        assert done.stderr.strip().splitlines()[-1].startswith("infinity config: 'optimizer' is null")


def test_an_internal_error_is_not_dressed_as_a_user_error():
    from infinity.cli.faults import guarded

    def bug() -> int:
        raise AttributeError("'NoneType' object has no attribute 'numel'")

    with pytest.raises(AttributeError):  # the traceback reaches the user, exit code 1
        guarded("train", bug, debug=False)


def test_a_sigterm_while_an_error_is_reported_keeps_that_error_as_the_one_line(monkeypatch, capsys):
    """When a rank dies, torchrun SIGTERMs the others, often while the survivor is reporting the peer's error
    (its classification imports modules): the report and its exit code stand, with no traceback."""
    from infinity.cli import faults
    from infinity.comm import CommError

    def classify_under_sigterm(exc):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the main thread, as torchrun's would be
        return real_classify(exc)

    def peer_died() -> int:
        raise CommError("rank 0/2: all-reduce of gradient norm failed: connection closed by peer")

    real_classify = faults.classify
    monkeypatch.setattr(faults, "classify", classify_under_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    assert faults.guarded("train", peer_died, debug=False) == ExitCode.PEER
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "all-reduce of gradient norm failed" in err and "Traceback" not in err
    assert signal.getsignal(signal.SIGTERM) == before


def test_help_lists_every_exit_code(tmp_path):
    done = _infinity(["--help"], tmp_path)
    assert done.returncode == 0
    for code in ExitCode:
        assert f"\n  {code.value} " in done.stdout, code


# -- a peer that stops --------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_stopped_or_dead_peer_ends_the_run_in_one_line_long_before_the_collective_timeout(tmp_path, signum):
    from datetime import timedelta

    import torch.distributed as dist

    heartbeat_s, comm_timeout_s = 3, 600
    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"heartbeat_timeout_s": heartbeat_s, "comm_timeout_s": comm_timeout_s},
            }
        )
    )
    # The rendezvous store lives here, as torchrun's agent hosts it: stopping a rank does not stop the store.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    args = ["train", "--model", "tiny", "--config", "ds.json", "--steps", "100000", "--offload", "nvme"]
    args += ["--nvme-path", "nvme"]
    ranks = []
    for rank in range(2):
        launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank), "WORLD_SIZE": "2"}
        launch.update(LOCAL_RANK=str(rank), TORCHELASTIC_USE_AGENT_STORE="True")
        ranks.append(_popen([*args, "--save-dir", f"ck{rank}"], tmp_path, **launch))
    swap0 = tmp_path / "nvme" / "infinity-rank0.swap"
    try:
        _wait_for(lambda: swap0.exists() and (tmp_path / "nvme" / "infinity-rank1.swap").exists(), ranks[0], "swap")
        assert "infinity: GPT 'tiny'" in ranks[0].stdout.readline()  # printed once training is about to start
        ranks[1].send_signal(signum)
        _, err = ranks[0].communicate(timeout=TIMEOUT_S)  # well before comm_timeout_s
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
    assert ranks[0].returncode == ExitCode.PEER
    line = _one_line(err)
    if signum == signal.SIGSTOP:  # only the heartbeat can tell: the stopped rank's connections stay open
        assert line.startswith("infinity train: rank 0: rank 1 has sent no heartbeat for "), line
        assert f"heartbeat_timeout_s, is {heartbeat_s} s" in line and "stopped, hung" in line
    else:  # a closed connection: the collective fails at once
        assert line.startswith("infinity train: rank 0/2: "), line
        assert "a peer rank has probably died" in line
    assert not swap0.exists()  # the abort ran the storage's cleanups
