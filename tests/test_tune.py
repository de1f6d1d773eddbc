"""`infinity tune`: the knobs, the search, the "auto" prefetch, byte-size prefetch values, the CLI, and
tune finding a faster config than a deliberately bad one on this machine."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infinity.cli import main
from infinity.cli.train import build_config
from infinity.config import ConfigError, load_config, resolve_auto
from infinity.profiler.synthetic import SCENARIOS, write_scenario
from infinity.profiler.traces import RankTrace
from infinity.tuning.auto_prefetch import auto_prefetch
from infinity.tuning.knobs import (
    BLOCK_SIZE,
    INTRA_OP,
    OPTIMIZER_BUFFERS,
    ORDER,
    PARAM_BUFFERS,
    PREFETCH,
    QUEUE_DEPTH,
    Knob,
    all_knobs,
    applicable,
    select,
)
from infinity.tuning.search import Budget, CoordinateDescent, noise_threshold
from infinity.tuning.trial import TrialResult

# -- prefetch given in bytes -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bf16", "elems"),
    [("64MB", False, 16_000_000), ("64MB", True, 32_000_000), ("1GiB", False, 1 << 28), ("1.5 kb", True, 750)],
)
def test_prefetch_bucket_in_bytes_becomes_elements_of_the_compute_dtype(text, bf16, elems):
    cfg = load_config({"bf16": {"enabled": bf16}, "zero_optimization": {"stage3_prefetch_bucket_size": text}})
    assert resolve_auto(cfg, hidden_size=8).zero_optimization.stage3_prefetch_bucket_size == elems


def test_prefetch_bytes_follow_the_dtype_given_on_the_command_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage3_prefetch_bucket_size": "8MiB"}}))
    args = argparse.Namespace(config=str(path), offload=None, nvme_path=None, dtype="bf16", steps=10)
    assert build_config(args, 32).zero_optimization.stage3_prefetch_bucket_size == (8 << 20) // 2


def test_a_size_without_a_known_unit_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"'zero_optimization\.stage3_prefetch_bucket_size' is '64XB'.*\"64MB\""):
        load_config({"zero_optimization": {"stage3_prefetch_bucket_size": "64XB"}})
    with pytest.raises(ConfigError, match=r"'zero_optimization\.reduce_bucket_size' must be an integer"):
        load_config({"zero_optimization": {"reduce_bucket_size": "64MB"}})  # only keys that allow bytes


# -- knobs -------------------------------------------------------------------------------------


def test_a_knob_writes_its_key_into_a_copy_and_drops_its_alias():
    raw = {"aio": {"thread_count": 4, "queue_depth": 2}, "train_batch_size": 8}
    out = all_knobs(1000)[INTRA_OP].write(raw, 2)
    assert out == {"aio": {"queue_depth": 2, "intra_op_parallelism": 2}, "train_batch_size": 8}
    assert raw["aio"] == {"thread_count": 4, "queue_depth": 2}  # the original is untouched
    assert all_knobs(1000)[QUEUE_DEPTH].write({}, 16) == {"aio": {"queue_depth": 16}}


def test_ladders_step_to_the_next_value_either_way():
    knob = all_knobs(1000)[BLOCK_SIZE]
    assert knob.ladder[0] == 4096 and knob.ladder[-1] == 16 << 20
    assert knob.next_value(4096, 1) == 16384 and knob.next_value(100_000, -1) == 65536
    assert knob.next_value(16 << 20, 1) is None
    assert all_knobs(1000)["zero_optimization.stage3_prefetch_bucket_size"].ladder == (0, 1000, 2000, 4000, 8000, 16000)


def test_buffer_counts_and_aio_are_searched_only_with_nvme_offload():
    resolved = load_config({"zero_optimization": {"offload_param": {"device": "cpu"}}}).to_dict()
    assert applicable(resolved) == ["zero_optimization.stage3_prefetch_bucket_size"]
    resolved = load_config({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "x"}}}).to_dict()
    assert "zero_optimization.offload_param.buffer_count" not in applicable(resolved)
    assert applicable(resolved)[-3:] == [QUEUE_DEPTH, BLOCK_SIZE, INTRA_OP]
    assert select(ORDER, "queue_depth, aio.block_size") == [QUEUE_DEPTH, BLOCK_SIZE]
    with pytest.raises(ValueError, match="unknown knob 'depth'"):
        select(ORDER, "depth")


def test_the_prefetch_bucket_is_searched_only_where_blocks_are_gathered():
    resolved = load_config({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}).to_dict()
    assert PREFETCH not in applicable(resolved)  # one rank keeps device-resident blocks in place


# -- only values that change something ---------------------------------------------------------

NVME = {"device": "nvme", "nvme_path": "/nvme"}
GPU = torch.device("cuda", 0)  # a GPU's placement: gathers read the device tier, not host memory


def _effective(zero: dict, name: str):
    from infinity.cli.tune import _block_plan
    from infinity.tuning.effects import effective_knob

    cfg = resolve_auto(load_config({"zero_optimization": {"block_classes": ["Block"], **zero}}), hidden_size=64)
    return effective_knob(all_knobs(1000)[name], cfg, _block_plan("small", 64, cfg), GPU)


def _plan(zero: dict, name: str, value: int):
    from infinity.cli.tune import _block_plan
    from infinity.tuning.effects import budget_plan, with_value

    cfg = resolve_auto(load_config({"zero_optimization": {"block_classes": ["Block"], **zero}}), hidden_size=64)
    return budget_plan(with_value(cfg, name, value), _block_plan("small", 64, cfg), GPU)


@pytest.mark.parametrize(
    ("zero", "why"),
    [
        ({"offload_param": NVME, "offload_optimizer": {"device": "cpu"}}, "a shard lives on the host"),
        ({"offload_param": NVME, "offload_optimizer": NVME, "host_budget_bytes": 1 << 30}, "host_budget_bytes is set"),
    ],
)
def test_the_parameter_buffer_count_is_not_tuned_where_no_budget_depends_on_it(zero, why):
    knob, note = _effective(zero, PARAM_BUFFERS)
    assert knob is None and why in note
    plans = {str(_plan(zero, PARAM_BUFFERS, v)) for v in all_knobs(1000)[PARAM_BUFFERS].ladder}
    assert len(plans) == 1  # the reason it is not tuned: every value gives the same plan


def test_each_tuned_buffer_count_value_gives_its_own_budget_plan():
    # read-ahead buffers of 1e5 elements on the small GPT's 1.2M parameters, in blocks: 5 of them hold some
    zero = {"stage3_param_persistence_threshold": 0, "offload_param": {**NVME, "buffer_size": 100_000},
            "offload_optimizer": NVME}  # fmt: skip
    for name in (PARAM_BUFFERS, OPTIMIZER_BUFFERS):
        knob, _ = _effective(zero, name)
        assert knob is not None and (5 if name == PARAM_BUFFERS else 4) in knob.ladder  # the defaults stay
        plans = [_plan(zero, name, v) for v in knob.ladder]
        assert all(a != b for i, a in enumerate(plans) for b in plans[i + 1 :]), name
    # the read-ahead stops growing at max_in_cpu (1e6 elements = 10 buffers of 1e5): 12 and 16 give one plan
    capped = {**zero, "offload_param": {**zero["offload_param"], "max_in_cpu": 1_000_000}}
    param_knob, _ = _effective(capped, PARAM_BUFFERS)
    assert max(param_knob.ladder) == 12 and 16 not in param_knob.ladder


def test_the_parameter_buffer_count_is_not_tuned_where_the_read_ahead_holds_every_parameter_already():
    """The default buffers (5 x 1e8 elements) hold all of a small model's parameters at any count: the plans
    differ only in a host bound nothing reaches, and a user's tune spent trials there on parameters it never
    read from disk after the first pass."""
    zero = {"stage3_param_persistence_threshold": 0, "offload_param": NVME, "offload_optimizer": NVME}
    knob, note = _effective(zero, PARAM_BUFFERS)
    assert knob is None and "the read-ahead is the same at every value on its ladder" in note
    plans = {_plan(zero, PARAM_BUFFERS, v).param_read_ahead_bytes for v in all_knobs(1000)[PARAM_BUFFERS].ladder}
    assert len(plans) > 1  # what the engine's plan says; none of it is ever filled


def test_tune_says_which_knob_changes_nothing_and_exits_2_when_none_is_left(tmp_path, capsys):
    path = tmp_path / "cfg.json"
    zero = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}, "offload_optimizer": {"device": "cpu"}}
    path.write_text(json.dumps({"zero_optimization": zero}))
    assert main(["tune", "--config", str(path), "--model", "tiny", "--knobs", PARAM_BUFFERS]) == 2
    err = capsys.readouterr().err
    assert "not tuning zero_optimization.offload_param.buffer_count: it changes nothing here" in err
    assert "no knob to tune" in err


# -- the search, against a made-up machine -----------------------------------------------------

QD = Knob(QUEUE_DEPTH, (1, 2, 4, 8, 16, 32))
BS = Knob(BLOCK_SIZE, (4096, 16384, 65536, 262144))


def _machine(settings: dict[str, int]) -> TrialResult:
    """A disk that gains from queue depth up to 8 and from block size up to 64 KiB, nothing beyond."""
    step = 0.1 + 1.0 / min(settings[QUEUE_DEPTH], 8) + 4096 / min(settings[BLOCK_SIZE], 65536)
    return TrialResult(step_s=[step] * 5)


def test_coordinate_descent_climbs_each_ladder_until_no_gain_and_confirms_back_to_back():
    seen: list[dict[str, int]] = []

    def measure(settings):
        seen.append(dict(settings))
        return _machine(settings)

    result = CoordinateDescent([QD, BS], {QUEUE_DEPTH: 1, BLOCK_SIZE: 4096}, measure, Budget(60)).run()
    assert result.best.settings == {QUEUE_DEPTH: 8, BLOCK_SIZE: 65536}
    assert [t.change for t in result.trials] == [
        "baseline",
        "aio.queue_depth 1 -> 2",  # the grid: two ladder values up (none below 1)
        "aio.queue_depth 1 -> 4",
        "aio.queue_depth 4 -> 8",  # 4 won at the grid's edge: onward while faster
        "aio.queue_depth 8 -> 16",
        "confirm aio.queue_depth = 8",
        "re-run aio.queue_depth = 1",
        "aio.block_size 4 KiB -> 16 KiB",
        "aio.block_size 4 KiB -> 64 KiB",
        "aio.block_size 64 KiB -> 256 KiB",
        "confirm aio.block_size = 64 KiB",
        "re-run aio.block_size = 4 KiB",
    ]
    assert [t.verdict for t in result.trials][4:7] == ["no gain", "confirmed", "slower, as before"]
    assert seen[6] == {QUEUE_DEPTH: 1, BLOCK_SIZE: 4096}  # the previous best, re-measured right after


def test_one_noisy_trial_does_not_end_a_knobs_search():
    def measure(settings):  # a burst of load hits the first step up; the next one still shows the gain
        noisy = settings[QUEUE_DEPTH] == 2 and len(seen) == 1
        seen.append(settings)
        return TrialResult(step_s=[5.0 if noisy else 1.0 / min(settings[QUEUE_DEPTH], 8)] * 5)

    seen: list[dict[str, int]] = []
    result = CoordinateDescent([QD], {QUEUE_DEPTH: 1}, measure, Budget(60)).run()
    assert result.best.settings == {QUEUE_DEPTH: 8}


def test_the_search_steps_down_when_up_does_not_help():
    def measure(settings):  # more queue depth than 4 hurts
        return TrialResult(step_s=[1.0 + abs(settings[QUEUE_DEPTH] - 4) * 0.5] * 5)

    result = CoordinateDescent([QD], {QUEUE_DEPTH: 32}, measure, Budget(60)).run()
    assert result.best.settings == {QUEUE_DEPTH: 4}
    assert [t.change for t in result.trials][1:5] == [
        "aio.queue_depth 32 -> 16",
        "aio.queue_depth 32 -> 8",
        "aio.queue_depth 8 -> 4",
        "aio.queue_depth 4 -> 2",
    ]


def test_a_lucky_trial_that_does_not_repeat_is_reverted():
    calls = {"n": 0}

    def measure(settings):
        calls["n"] += 1
        lucky = settings[QUEUE_DEPTH] == 2 and calls["n"] == 2  # fast once, as a quiet moment would make it
        return TrialResult(step_s=[0.5 if lucky else 1.0] * 5)

    result = CoordinateDescent([QD], {QUEUE_DEPTH: 1}, measure, Budget(60)).run()
    assert result.best.settings == {QUEUE_DEPTH: 1}
    verdicts = [(t.change, t.verdict) for t in result.trials[-4:]]
    assert verdicts == [
        ("confirm aio.queue_depth = 2", "not confirmed: once more"),
        ("re-run aio.queue_depth = 1", "as fast"),
        ("confirm aio.queue_depth = 2", "not confirmed: back to 1"),
        ("re-run aio.queue_depth = 1", "as fast"),
    ]
    assert result.threshold == 0.25  # two runs of queue depth 2 differed 2x: a gain must now be large


def test_a_second_pair_breaks_a_tie_against_a_real_gain():
    calls = {"n": 0}

    def measure(settings):
        calls["n"] += 1
        burst = calls["n"] == 3  # load hits the first confirmation run of queue depth 2
        return TrialResult(step_s=[3.0 if burst else 1.0 / settings[QUEUE_DEPTH]] * 5)

    result = CoordinateDescent([Knob(QUEUE_DEPTH, (1, 2))], {QUEUE_DEPTH: 1}, measure, Budget(60)).run()
    assert result.best.settings == {QUEUE_DEPTH: 2}
    assert [t.verdict for t in result.trials[2:]] == [
        "not confirmed: once more",
        "as fast",
        "confirmed",
        "slower, as before",
    ]


def test_on_a_noisy_machine_a_flat_grid_gets_a_second_look():
    calls: list[int] = []

    def measure(settings):
        calls.append(settings[QUEUE_DEPTH])
        if len(calls) == 1:
            return TrialResult(step_s=[1.0, 1.5, 2.0, 2.5, 3.0])  # a noisy baseline: the threshold is high
        if len(calls) in (2, 3):
            return TrialResult(step_s=[8.0 - len(calls)] * 5)  # a burst of load as long as the grid
        return TrialResult(step_s=[2.0 / settings[QUEUE_DEPTH]] * 5)

    result = CoordinateDescent([Knob(QUEUE_DEPTH, (1, 2, 4))], {QUEUE_DEPTH: 1}, measure, Budget(60)).run()
    assert result.best.settings == {QUEUE_DEPTH: 4}
    assert [(t.change, t.verdict) for t in result.trials[1:]] == [
        ("aio.queue_depth 1 -> 2", "no gain"),
        ("aio.queue_depth 1 -> 4", "no gain"),
        ("aio.queue_depth 1 -> 4 (second look)", "faster"),
        ("re-run aio.queue_depth = 1", "reference"),
        ("confirm aio.queue_depth = 4", "confirmed"),
        ("re-run aio.queue_depth = 1", "slower, as before"),
    ]


def test_a_knob_that_does_not_matter_gets_no_second_look():
    def measure(settings):  # noisy steps, the same for every queue depth
        return TrialResult(step_s=[1.0, 1.5, 2.0, 2.5, 3.0])

    result = CoordinateDescent([Knob(QUEUE_DEPTH, (1, 2, 4))], {QUEUE_DEPTH: 1}, measure, Budget(60)).run()
    assert [t.change for t in result.trials] == ["baseline", "aio.queue_depth 1 -> 2", "aio.queue_depth 1 -> 4"]


class _TrialBudget(Budget):
    """A budget of a fixed number of trials, for a search whose trials take no time."""

    def __init__(self, trials: int) -> None:
        super().__init__(60)
        self.trials = trials

    def fits(self, trials: int = 1) -> bool:
        return len(self.walls_s) + trials <= self.trials


def test_without_budget_for_a_tie_break_all_runs_of_both_settings_decide():
    calls = {"n": 0}

    def measure(settings):
        calls["n"] += 1
        fast = settings[QUEUE_DEPTH] == 2 and calls["n"] == 2  # the grid's run; its confirmation ran in a burst
        return TrialResult(step_s=[0.4 if fast else 1.0] * 5)

    knob = Knob(QUEUE_DEPTH, (1, 2))
    result = CoordinateDescent([knob], {QUEUE_DEPTH: 1}, measure, _TrialBudget(5)).run()
    assert result.best.settings == {QUEUE_DEPTH: 2}  # median of its 10 steps 0.7 vs 1.0 for depth 1
    assert result.notes == [
        "aio.queue_depth = 2 chosen on all its runs so far (no budget left for a tie-breaking pair)"
    ]


def test_failed_trials_are_no_gain_and_the_budget_stops_the_search():
    def measure(settings):
        if settings[QUEUE_DEPTH] == 2:
            return TrialResult(error="exit 1: out of memory")
        return TrialResult(step_s=[1.0] * 5)

    result = CoordinateDescent([QD, BS], {QUEUE_DEPTH: 1, BLOCK_SIZE: 4096}, measure, Budget(60)).run()
    assert result.trials[1].verdict == "failed: exit 1: out of memory" and result.best.settings[QUEUE_DEPTH] == 1
    result = CoordinateDescent([QD, BS], {QUEUE_DEPTH: 1, BLOCK_SIZE: 4096}, measure, Budget(0)).run()
    assert [t.change for t in result.trials] == ["baseline"] and result.stopped_by_budget


def test_the_noise_threshold_is_the_spread_of_a_median():
    assert noise_threshold([1.0] * 5) == 0.03  # a quiet machine: the floor
    assert noise_threshold([1.0, 1.1, 1.2, 1.3, 1.4]) == pytest.approx(2 * (1.3 - 1.1) / 1.2 / 5**0.5)
    assert noise_threshold([0.1, 5.0, 0.2, 9.0]) == 0.25  # a very noisy one: capped


def test_swap_files_left_by_a_killed_trial_are_removed_but_not_a_live_runs(tmp_path):
    import fcntl

    from infinity.storage.nvme_file import MAGIC
    from infinity.tuning.trial import remove_stale_swap_files

    stale, live, foreign = (tmp_path / n for n in ("infinity-rank0.swap", "infinity-rank1.swap", "infinity-rank2.swap"))
    stale.write_bytes(MAGIC + bytes(4088))
    live.write_bytes(MAGIC + bytes(4088))
    foreign.write_bytes(b"not a swap file")
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # as a running store holds its file
        assert remove_stale_swap_files([str(tmp_path)]) == [str(stale)]
    assert not stale.exists() and live.exists() and foreign.exists()


# -- "auto" prefetch from a trace ----------------------------------------------------------------


def _trace(records: list[dict]) -> RankTrace:
    trace = RankTrace("mem", {"type": "meta", "version": 1, "rank": 0, "world_size": 1, "t0_ns": 0})
    for r in records:
        trace.records[r["type"]].append(r)
    return trace


def _move(block, kind, start_ms, end_ms, nbytes, phase="forward", src="nvme", dst="host"):
    key = f"('{block}#0', '{kind}')"
    ms = 1_000_000
    return {"type": "move", "key": key, "block": f"{block}#0", "bytes": nbytes, "src": src, "dst": dst,
            "start_ns": int(start_ms * ms), "end_ns": int(end_ms * ms), "step": 1, "phase": phase}  # fmt: skip


def _compute(block, start_ms, end_ms, phase="forward"):
    ms = 1_000_000
    return {"type": "compute", "block": block, "start_ns": int(start_ms * ms), "end_ns": int(end_ms * ms),
            "step": 1, "phase": phase}  # fmt: skip


def test_auto_prefetch_covers_the_read_time_of_a_block_with_compute():
    # Two 8 MB blocks read one after the other in 4 ms each (2 GB/s busy); forward compute 1.5 ms per
    # block: ceil(4 / 1.5 + 1) = 4 blocks. Root reads, optimizer reads and gradients do not count.
    records = [
        _move("blocks.0", "param", 0, 4, 8_000_000),
        _move("blocks.1", "param", 4, 8, 8_000_000),
        _move("<root>", "param", 0, 1, 1_000_000),
        _move("blocks.0", "master", 20, 30, 8_000_000, phase="optimizer"),
        _move("blocks.0", "grad", 9, 10, 8_000_000, phase="backward", src="host", dst="nvme"),
        _compute("blocks.0", 8, 9.5),
        _compute("blocks.1", 9.5, 11),
        _compute("blocks.1", 11, 14, phase="backward"),
        _compute("<root>", 14, 20),
    ]
    evidence = auto_prefetch([_trace(records)], "nvme", block_elems=2_000_000)
    assert evidence.read_gbps == pytest.approx(2.0) and evidence.read_s == pytest.approx(0.004)
    assert evidence.compute_s == pytest.approx(0.0015)
    assert (evidence.blocks_ahead, evidence.bucket_elems) == (4, 8_000_000)
    assert "ceil(4.00 / 1.50 + 1) = 4 blocks x 2,000,000 elements" in str(evidence)


def test_auto_prefetch_says_what_the_trace_lacks():
    with pytest.raises(ValueError, match="no nvme->host parameter reads"):
        auto_prefetch([_trace([_compute("blocks.0", 0, 1)])], "nvme", 100)
    with pytest.raises(ValueError, match="parameters live on the device"):
        auto_prefetch([_trace([])], "none", 100)


# -- the command line --------------------------------------------------------------------------


def test_tune_reports_bad_input_and_exits_2(tmp_path, capsys):
    assert main(["tune", "--config", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    assert main(["tune", "--config", str(path), "--model", "tiny", "--knobs", "queue_depth"]) == 2
    assert "no knob to tune" in capsys.readouterr().err
    assert main(["tune", "--config", str(path), "--model", "tiny", "--knobs", "depth"]) == 2
    assert "unknown knob 'depth'" in capsys.readouterr().err


def test_tune_refuses_an_out_or_work_dir_it_could_not_write_before_any_trial(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    (tmp_path / "afile").write_text("x")
    cases = [
        (["--out", str(tmp_path / "afile" / "t.json")], "--out", "is a file, not a folder"),
        (["--out", str(tmp_path)], "--out", "is a folder, not a file"),
        (["--work-dir", str(tmp_path / "afile")], "--work-dir", "is a file, not a folder"),
    ]
    for extra, flag, why in cases:
        assert main(["tune", "--config", str(path), "--model", "tiny", *extra]) == 2
        out, err = capsys.readouterr()
        assert err.startswith(f"infinity tune: {flag} '") and why in err and "knobs:" not in out  # no trial ran


def test_profile_command_reads_traces(tmp_path, capsys):
    write_scenario(str(tmp_path / "traces"), SCENARIOS["starved"])
    assert main(["profile", str(tmp_path / "traces"), "--no-plots", "--out", str(tmp_path / "report")]) == 0
    assert "infinity swap profile" in capsys.readouterr().out
    assert (tmp_path / "report" / "summary.json").is_file()


def test_train_profile_flag_writes_traces_under_the_save_dir(tmp_path, capsys):
    save = tmp_path / "run"
    args = ["train", "--model", "tiny", "--steps", "2", "--offload", "cpu", "--save-dir", str(save), "--profile"]
    assert main(args) == 0
    assert (save / "profile" / "trace_rank0.jsonl").is_file()
    assert f"infinity profile {save / 'profile'}" in capsys.readouterr().out


# -- end to end: tune beats a deliberately bad config ------------------------------------------

# Parameters on NVMe with every I/O setting at its worst: 4 KiB requests (the minimum) one at a
# time, no prefetch, one staging buffer. The "small" GPT with a short sequence and batch 1 keeps compute small, so the
# step is mostly swap I/O and the bad settings cost several times the step (optimizer on the CPU:
# its NVMe traffic would triple a bad trial's time, and the test's, without showing anything more).
BAD = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {
        "stage": 3,
        "block_classes": ["Block"],
        "stage3_param_persistence_threshold": 0,  # every weight matrix goes through the swap path
        "stage3_prefetch_bucket_size": 0,
        "offload_param": {"device": "nvme", "buffer_count": 1},
        "offload_optimizer": {"device": "cpu"},
    },
    "aio": {"block_size": 4096, "queue_depth": 1, "intra_op_parallelism": 1},
}
MODEL, SEQ = "small", 8


def _python_m_infinity(args: list[str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run(
        [sys.executable, "-m", "infinity", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def _step_times_s(config_path: Path, steps: int = 5) -> list[float]:
    """The step times after a warm-up step, measured here with the public API (not with tune's trials)."""
    import infinity
    from infinity.data.corpus import ByteBatches, load_corpus
    from infinity.models.gpt import GPT, gpt_preset

    model_cfg = gpt_preset(MODEL, block_size=SEQ)
    args = argparse.Namespace(config=str(config_path), offload=None, nvme_path=None, dtype=None, steps=steps)
    engine, _, _, _ = infinity.initialize(model=GPT(model_cfg), config=build_config(args, model_cfg.n_embd))
    try:
        data = ByteBatches(load_corpus("train"), 1, SEQ)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            x, y = next(data)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            loss.item()
            times.append(time.perf_counter() - start)
        return times[1:]
    finally:
        engine.close()


def _lower_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4, method="inclusive")[0]


def test_tune_finds_a_faster_config_than_a_bad_one(tmp_path):
    """Tune a bad config's aio request size, then time the bad and the tuned config again, interleaved.

    What is asserted, and why this way: the machine running the tests is shared and noisy (other
    jobs' CPU, memory bandwidth and I/O come and go within seconds; one config's median step has
    varied 5x between two runs a minute apart), so no speedup figure can be asserted. Tune guards its
    own decisions against that: a move counts only past the measured noise and is re-measured back
    to back with the previous best. Under a long enough burst it keeps the config as given rather
    than guess; the test then runs it once more. The test checks (1) the direction: tune raised
    `aio.block_size` from 4 KiB, which cuts the serialized requests per step by 4x or more, a gain
    load can hide but not reverse, and changed nothing else; and (2) the timing: bad and tuned
    re-measured back to back in three rounds of alternating order, the tuned config's step time may
    not exceed the bad one's by more than a 10% noise margin (not slower beyond noise). The step
    time compared is the lower quartile of each config's pooled steps rather than the median: load
    only ever adds time, and bursts here have covered two of three rounds of one config (its median
    then measured the burst); the lower quartile stands while a quarter of the steps ran unhindered.
    On a quiet machine the tuned config is several times faster; both statistics are printed. The
    search is restricted to one knob (`--knobs`) to fit the test's time: a bad trial costs seconds.
    """
    nvme = tmp_path / "nvme"
    bad_path = tmp_path / "bad.json"
    raw = json.loads(json.dumps(BAD))
    raw["zero_optimization"]["offload_param"]["nvme_path"] = str(nvme)
    bad_path.write_text(json.dumps(raw, indent=2))

    args = ["tune", "--config", str(bad_path), "--model", MODEL, "--seq", str(SEQ), "--steps", "6"]
    args += ["--knobs", "block_size", "--budget-minutes", "3"]  # a quiet machine finishes the grid in ~20 s
    for _attempt in range(2):  # see the docstring: under heavy load tune may, rightly, keep the config once
        done = _python_m_infinity(args, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        out = done.stdout
        if "best: the config as given" not in out:
            break
    assert "median step s" in out and "speedup" in out and "baseline" in out, out
    tuned_path = tmp_path / "bad.tuned.json"
    assert f"wrote {tuned_path}" in out and f"infinity train --config {tuned_path} --model small" in out, out
    assert not list(nvme.glob("*.swap")), "every trial removes its swap file"

    tuned = json.loads(tuned_path.read_text())
    assert tuned["aio"]["block_size"] > raw["aio"]["block_size"], out
    tuned["aio"]["block_size"] = raw["aio"]["block_size"]
    assert tuned == raw, "only the tuned key changes"

    bad_s: list[float] = []
    tuned_s: list[float] = []
    for first_bad in (True, False, True):  # rounds of back-to-back runs, in alternating order
        for path in (bad_path, tuned_path) if first_bad else (tuned_path, bad_path):
            (bad_s if path == bad_path else tuned_s).extend(_step_times_s(path))
    bad_q1, tuned_q1 = _lower_quartile(bad_s), _lower_quartile(tuned_s)
    print(f"\n{out}\nre-measured lower quartiles: bad {bad_q1:.4f} s, tuned {tuned_q1:.4f} s")
    print(f"medians: bad {statistics.median(bad_s):.4f} s, tuned {statistics.median(tuned_s):.4f} s")
    assert tuned_q1 <= bad_q1 * 1.10, (bad_s, tuned_s, out)
    assert not list(nvme.glob("*.swap"))


def test_tune_sizes_auto_prefetch_from_a_profiled_trial(tmp_path):
    raw = json.loads(json.dumps(BAD))
    raw["zero_optimization"]["offload_param"]["nvme_path"] = str(tmp_path / "nvme")
    raw["aio"] = {}  # reads fast enough that a trial is short
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    args = ["tune", "--config", str(path), "--model", "tiny", "--steps", "3", "--knobs", "stage3_prefetch_bucket_size"]
    # the budget must cover the baseline and the profiled trial on a loaded machine too; a quiet one stops early
    done = _python_m_infinity([*args, "--budget-minutes", "1.5"], cwd=tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "auto prefetch: parameter reads nvme->host at" in done.stdout, done.stdout
    assert "(auto)" in done.stdout and (tmp_path / "cfg.tuned.json").is_file()
