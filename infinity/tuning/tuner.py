"""A tuning session: the user's config, its trials' configs, the profiled trial and the search.

`Tuner.run` measures the config as given (the baseline), profiles one trial to size the "auto"
prefetch bucket, then searches the knobs (`search.CoordinateDescent`). Trial configs are the user's
file with only the knobs that differ from it changed and its profiler section dropped; they, the
worker's log and the profiled trace live in `work_dir`. NVMe swap files go where the config (or
`nvme_path`) says, and each trial removes its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infinity.tuning.auto_prefetch import PrefetchEvidence, auto_prefetch
from infinity.tuning.knobs import PREFETCH, Knob
from infinity.tuning.search import Budget, CoordinateDescent, SearchResult, Settings, Trial
from infinity.tuning.trial import TrialResult, TrialRunner, TrialSpec

MIN_TRIAL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TuneJob:
    """What to tune: the user's raw config and its resolved form, the model, and the trial shape."""

    raw: dict[str, Any]
    resolved: dict[str, Any]  # InfinityConfig.to_dict() of the config as `infinity train` resolves it
    knobs: list[Knob]
    model: str
    steps: int
    budget_s: float
    work_dir: Path
    block_elems: int
    seq: int | None = None
    nvme_path: str | None = None
    dtype: str | None = None
    seed: int = 1234
    fresh_process: bool = False


@dataclass
class TuneOutcome:
    search: SearchResult
    start: Settings
    prefetch: PrefetchEvidence | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Settings:
        return self.search.best.settings


def tuned_config(raw: dict[str, Any], knobs: list[Knob], start: Settings, settings: Settings) -> dict[str, Any]:
    """`raw` with every knob whose value differs from `start` set to its value in `settings`."""
    out = raw
    for knob in knobs:
        if settings[knob.name] != start[knob.name]:
            out = knob.write(out, settings[knob.name])
    return out


class Tuner:
    """Runs one session; `say` gets the progress lines."""

    def __init__(self, job: TuneJob, say: Callable[[str], None] = print) -> None:
        self.job = job
        self.say = say
        self.start: Settings = {k.name: k.read(job.resolved) for k in job.knobs}
        self._count = 0
        self._timeout_s = max(MIN_TRIAL_TIMEOUT_S, job.budget_s)

    def _spec(self, settings: Settings, profile_dir: Path | None = None) -> TrialSpec:
        raw = tuned_config(self.job.raw, self.job.knobs, self.start, settings)
        raw = {k: v for k, v in raw.items() if k != "profiler"}
        path = self.job.work_dir / f"trial{self._count}.json"
        self._count += 1
        path.write_text(json.dumps(raw, indent=2))
        j = self.job
        return TrialSpec(
            str(path), j.model, j.steps, j.seq, j.nvme_path, j.dtype, j.seed, str(profile_dir) if profile_dir else None
        )

    def _measure(self, runner: TrialRunner, settings: Settings) -> TrialResult:
        return runner.run(self._spec(settings), self._timeout_s)

    def _profile(self, runner: TrialRunner) -> tuple[PrefetchEvidence | None, str]:
        """One profiled trial of the starting settings; the "auto" prefetch it implies, or why none."""
        from infinity.profiler.traces import load_traces

        folder = self.job.work_dir / "profile"
        result = runner.run(self._spec(self.start, folder), self._timeout_s)
        if result.error is not None:
            return None, f"the profiled trial failed: {result.error}"
        param_device = self.job.resolved["zero_optimization"]["offload_param"]["device"]
        try:
            return auto_prefetch(load_traces([folder]), param_device, self.job.block_elems), ""
        except (OSError, ValueError) as exc:
            return None, str(exc)

    def _on_trial(self, trial: Trial, baseline: Trial) -> None:
        from infinity.tuning.report import progress_line

        if trial is baseline and trial.result.error is None:
            self._timeout_s = max(MIN_TRIAL_TIMEOUT_S, 3 * trial.wall_s + 30)
        self.say(progress_line(trial, baseline))

    def run(self) -> TuneOutcome:
        budget = Budget(self.job.budget_s)
        notes: list[str] = []
        evidence = None
        zero = self.job.resolved["zero_optimization"]
        swap_dirs = sorted(
            {s["nvme_path"] for s in (zero["offload_param"], zero["offload_optimizer"]) if s["nvme_path"]}
        )
        log = self.job.work_dir / "trials.log"
        with TrialRunner(log, fresh=self.job.fresh_process, swap_dirs=swap_dirs) as runner:
            candidates: dict[str, list[int]] = {}
            if any(k.name == PREFETCH for k in self.job.knobs):
                evidence, why = self._profile(runner)
                if evidence is not None:
                    self.say(f"auto prefetch: {evidence}")
                    candidates[PREFETCH] = [evidence.bucket_elems]
                else:
                    notes.append(f"auto prefetch not measured: {why}")
                    self.say(notes[-1])
            search = CoordinateDescent(
                self.job.knobs,
                self.start,
                lambda settings: self._measure(runner, settings),
                budget,
                candidates,
                on_trial=self._on_trial,
            ).run()
        notes += search.notes
        if search.stopped_by_budget:
            notes.append("the budget ran out before every knob was searched: raise --budget-minutes to go on")
        return TuneOutcome(search, self.start, evidence, notes)
