"""Tuning trials: short training runs of a GPT preset under a config, timed step by step.

Trials run in a worker process (`python -m infinity.tuning.trial`), never in the caller: a trial that
crashes, hangs or leaks memory costs its own timeout and a new worker, not the search. The worker takes
one trial spec per stdin line and answers one result line, so a search pays the interpreter's start
(seconds on a loaded machine, longer than a small model's trial) once; `TrialRunner(fresh=True)`
starts a new worker for every trial instead, for models whose trials are long enough not to care.
Every trial builds its own engine and closes it (`engine.close()` removes its NVMe swap files).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import gc
import glob
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

WARMUP_STEPS = 1  # the first step records the execution order and fills the caches: never timed
_MARK = "@@infinity-trial "  # prefixes the worker's result lines; anything else on stdout is ignored


@dataclass(frozen=True)
class TrialSpec:
    """What a trial trains: `steps` optimizer steps of GPT `model` under the JSON config `config_path`.

    `seq` defaults to `infinity train`'s; `nvme_path` and `dtype` override the config as
    `infinity train`'s flags do; `profile_dir`, when set, records a trace of every timed step there.
    """

    config_path: str
    model: str
    steps: int
    seq: int | None = None
    nvme_path: str | None = None
    dtype: str | None = None
    seed: int = 1234
    profile_dir: str | None = None


@dataclass
class TrialResult:
    """The timed steps (seconds, warm-up excluded) of a finished trial, or `error` when it failed."""

    step_s: list[float] = field(default_factory=list)
    stall_s: float = 0.0
    bytes_moved: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    @property
    def median_s(self) -> float:
        """The median timed step; infinity when the trial failed or timed nothing."""
        return statistics.median(self.step_s) if self.step_s and self.error is None else float("inf")


class TrialRunner:
    """Runs trials one at a time in a worker process, restarting it after a failure or a timeout.

    The worker's stderr goes to `log_path` (the last line is quoted in a failed trial's error). A
    worker that must be killed cannot close its engine, so the runner removes the swap files it left
    in `swap_dirs` (the config's NVMe folders). Use as a context manager, or call `close()`.
    """

    def __init__(self, log_path: str | Path, fresh: bool = False, swap_dirs: list[str] | None = None) -> None:
        self.log_path = Path(log_path)
        self.fresh = fresh
        self.swap_dirs = list(swap_dirs or [])
        self._proc: subprocess.Popen | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    def __enter__(self) -> TrialRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> subprocess.Popen:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "a")  # noqa: SIM115 - the worker owns it until it exits
        proc = subprocess.Popen(
            [sys.executable, "-m", "infinity.tuning.trial"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            bufsize=1,
        )
        log.close()
        self._lines = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, self._lines), daemon=True).start()
        return proc

    def run(self, spec: TrialSpec, timeout_s: float) -> TrialResult:
        """Run `spec`; a crash, a timeout or a config error comes back as `result.error`."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        deadline = time.monotonic() + max(1.0, timeout_s)
        try:
            self._proc.stdin.write(json.dumps(dataclasses.asdict(spec)) + "\n")
            self._proc.stdin.flush()
            while True:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
                if line is None:  # the worker died (a crash, the OOM killer): it left its swap files
                    remove_stale_swap_files(self.swap_dirs)
                    return TrialResult(error=f"the trial process exited: {self._last_log_line()}")
                if line.startswith(_MARK):
                    return TrialResult(**json.loads(line[len(_MARK) :]))
        except queue.Empty:
            self._kill()
            return TrialResult(error=f"timed out after {timeout_s:.0f} s")
        except BrokenPipeError:
            self._kill()
            return TrialResult(error=f"the trial process exited: {self._last_log_line()}")
        finally:
            if self.fresh:
                self.close()

    def _last_log_line(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path.is_file() else []
        return lines[-1] if lines else "no output"

    def close(self) -> None:
        """End the worker: it exits when its stdin closes; one that does not within seconds is stopped."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._stop(proc)

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            self._stop(proc)

    def _stop(self, proc: subprocess.Popen) -> None:
        """SIGTERM (the worker closes its engine, removing its swap files), then SIGKILL if it must."""
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            remove_stale_swap_files(self.swap_dirs)


def remove_stale_swap_files(dirs: list[str]) -> list[str]:
    """Remove infinity swap files in `dirs` that no live store holds (its lock is free); the removed paths."""
    from infinity.storage.nvme_file import MAGIC

    removed = []
    for directory in dirs:
        for path in glob.glob(os.path.join(glob.escape(directory), "infinity-rank*.swap")):
            try:
                with open(path, "rb") as fh:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a live run's
                    if fh.read(len(MAGIC)) != MAGIC:
                        continue
                os.unlink(path)
                removed.append(path)
            except OSError:
                continue
    return removed


def _pump(stream: TextIO, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


# -- the worker --------------------------------------------------------------------------------


def _profiled(raw: dict[str, Any], profile_dir: str, steps: int) -> dict[str, Any]:
    """`raw` with the profiler recording every timed step into `profile_dir`."""
    return {**raw, "profiler": {"enabled": True, "path": profile_dir, "start_step": WARMUP_STEPS, "end_step": steps}}


def train_timed(spec: TrialSpec) -> TrialResult:
    """Build the engine as `infinity train` would, train `spec.steps` steps, close it; the timings."""
    import torch

    import infinity
    from infinity.cli.train import DEFAULT_SEQ, build_config
    from infinity.data.corpus import ByteBatches, load_corpus
    from infinity.models.gpt import GPT, gpt_preset

    if spec.steps <= WARMUP_STEPS:
        raise ValueError(f"a trial needs more than {WARMUP_STEPS} step(s): the warm-up step is not timed")
    torch.set_flush_denormal(True)
    raw = json.loads(Path(spec.config_path).read_text())
    if spec.profile_dir:
        raw = _profiled(raw, spec.profile_dir, spec.steps)
    preset = gpt_preset(spec.model)
    model_cfg = gpt_preset(spec.model, block_size=min(spec.seq or DEFAULT_SEQ, preset.block_size))
    args = argparse.Namespace(config=raw, offload=None, nvme_path=spec.nvme_path, dtype=spec.dtype, steps=spec.steps)
    config = build_config(args, model_cfg.n_embd)
    for section in (config.zero_optimization.offload_param, config.zero_optimization.offload_optimizer):
        if section.device == "nvme":
            Path(section.nvme_path).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    engine, _, _, _ = infinity.initialize(model=GPT(model_cfg), config=config)
    try:
        micro = engine.config.train_micro_batch_size_per_gpu
        data = ByteBatches(load_corpus("train"), micro, model_cfg.block_size, spec.seed)
        step_s: list[float] = []
        for step in range(spec.steps):
            start = time.perf_counter()
            for _ in range(engine.gradient_accumulation_steps):
                x, y = next(data)
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            loss.item()  # waits for the device
            if step >= WARMUP_STEPS:
                step_s.append(time.perf_counter() - start)
        return TrialResult(step_s, engine.stall_s, engine.bytes_moved)
    finally:
        engine.close()  # removes this trial's swap files
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    """The worker: one JSON `TrialSpec` per stdin line, one result line (prefixed) per spec on stdout."""
    signal.signal(signal.SIGTERM, _exit)  # unwinds through the trial's `finally`: its swap files go
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            result = train_timed(TrialSpec(**json.loads(line)))
        except Exception as exc:  # noqa: BLE001 - any failure is this trial's result, not the worker's end
            result = TrialResult(error=f"{type(exc).__name__}: {exc}")
        print(_MARK + json.dumps(dataclasses.asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
