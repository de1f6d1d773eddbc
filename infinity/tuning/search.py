"""Coordinate descent over the knobs: one knob at a time, a small grid around its value, then onward.

For each knob in order: try its measured candidates (the "auto" prefetch) and GRID_STEPS ladder
values on each side of the current value; the fastest of them wins if its median step is below the
best's by more than the noise threshold. A single noisy trial cannot end a knob's search, as it
would a plain line search; on a noisy machine, a grid whose every value looks slower beyond the
noise (a burst of load, most likely) gets a second look at its fastest value, back to back with
the best. A winner at the grid's edge keeps stepping the same way while each step is faster. When
a knob moved, the new best and the previous best are run again back to back, and the knob keeps
its new value only if it is still faster by the threshold (a second pair breaks a tie between this
pair and the trial that chose it); otherwise it goes back.

The threshold starts from the spread of the baseline's steps and rises to the typical gap between
repeated runs of identical settings as they happen. No trial starts once the budget's deadline is
nearer than the recent trials took.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from infinity.tuning.knobs import Knob, format_value
from infinity.tuning.trial import TrialResult

MIN_GAIN = 0.03  # never count less than a 3% faster median as an improvement
MAX_GAIN = 0.25  # never ask for more than a 25% faster median
GRID_STEPS = 2  # ladder values tried on each side of a knob's starting value
CONFIRM_PAIRS = 2  # back-to-back pairs that may be run to confirm a knob's move (best of three votes)
SECOND_LOOK_NOISE = 0.1  # above this threshold the machine is noisy: a flat grid gets a second look

Settings = dict[str, int]
Measure = Callable[[Settings], TrialResult]


@dataclass
class Trial:
    """One measured run: the knob values it ran with, what changed, and the verdict on it."""

    index: int
    change: str  # "baseline", "aio.queue_depth 1 -> 8", "confirm aio.queue_depth = 8"
    settings: Settings
    result: TrialResult
    wall_s: float
    verdict: str = ""

    @property
    def median_s(self) -> float:
        return self.result.median_s


@dataclass
class Best:
    """The best settings so far and the step times of their latest run."""

    settings: Settings
    step_s: list[float]

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s) if self.step_s else float("inf")


@dataclass
class SearchResult:
    baseline: Trial
    best: Best
    trials: list[Trial] = field(default_factory=list)
    stopped_by_budget: bool = False
    threshold: float = MIN_GAIN  # the relative gain that counted as faster
    notes: list[str] = field(default_factory=list)  # decisions taken on less evidence, for lack of budget


def noise_threshold(step_s: list[float], floor: float = MIN_GAIN) -> float:
    """The relative gain a median must show to count: the uncertainty of a median of these steps.

    The interquartile range relative to the median, over sqrt(steps), is about the relative standard
    error of the median; twice that (two medians differ) and at least `floor`. It is capped at
    MAX_GAIN: on a machine that noisy, the back-to-back confirmation is the guard against luck, and a
    higher bar would refuse real gains of several tens of percent.
    """
    if len(step_s) < 2:
        return max(floor, 0.1)
    q1, _, q3 = statistics.quantiles(step_s, n=4, method="inclusive")
    spread = (q3 - q1) / statistics.median(step_s) / len(step_s) ** 0.5
    return min(MAX_GAIN, max(floor, 2 * spread))


class Budget:
    """A deadline; `fits(n)` says whether n more trials, each as long as the recent ones, end before it.

    "Recent" is the mean of the last three trials' wall times: the first trial also pays the worker's
    start and a bad starting config's slow steps, which later trials near the best do not.
    """

    RECENT = 3

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.walls_s: list[float] = []

    def note(self, wall_s: float) -> None:
        self.walls_s.append(wall_s)

    def fits(self, trials: int = 1) -> bool:
        recent = self.walls_s[-self.RECENT :]
        estimate_s = sum(recent) / len(recent) if recent else 0.0
        return time.monotonic() + trials * estimate_s <= self.deadline


class CoordinateDescent:
    """Runs the search; `on_trial` sees each trial as it finishes (for progress lines)."""

    def __init__(
        self,
        knobs: list[Knob],
        start: Settings,
        measure: Measure,
        budget: Budget,
        candidates: dict[str, list[int]] | None = None,
        on_trial: Callable[[Trial, Trial], None] | None = None,
        min_gain: float = MIN_GAIN,
    ) -> None:
        self.knobs = knobs
        self.start = dict(start)
        self.measure = measure
        self.budget = budget
        self.candidates = candidates or {}
        self.on_trial = on_trial or (lambda trial, baseline: None)
        self.min_gain = min_gain
        self.trials: list[Trial] = []
        self.threshold = min_gain  # set from the baseline's spread once it has run
        self.notes: list[str] = []  # decisions taken on less evidence than usual, for lack of budget
        self._medians: dict[tuple, list[float]] = {}  # settings -> median step of each of their runs
        self._repeat_gaps: list[float] = []  # relative differences between runs of identical settings

    def _run(self, settings: Settings, change: str) -> Trial:
        began = time.monotonic()
        result = self.measure(dict(settings))
        wall_s = time.monotonic() - began
        self.budget.note(wall_s)
        trial = Trial(len(self.trials), change, dict(settings), result, wall_s)
        self.trials.append(trial)
        if self._ok(trial):
            self._note_repeat(trial)
        return trial

    def _note_repeat(self, trial: Trial) -> None:
        """Raise the threshold to the typical difference between runs of identical settings.

        The baseline's spread measures the noise within one run; a burst of load that lasts a whole
        run shows only between runs, as two runs of the same settings that differ.
        """
        key = tuple(sorted(trial.settings.items()))
        for earlier in self._medians.get(key, []):
            self._repeat_gaps.append(abs(trial.median_s - earlier) / min(trial.median_s, earlier))
        self._medians.setdefault(key, []).append(trial.median_s)
        if self._repeat_gaps:
            between = statistics.median(self._repeat_gaps)
            self.threshold = min(MAX_GAIN, max(self.threshold, between))

    def _report(self, trial: Trial, verdict: str) -> None:
        trial.verdict = verdict if trial.result.error is None else f"failed: {trial.result.error}"
        self.on_trial(trial, self.trials[0])

    def run(self) -> SearchResult:
        baseline = self._run(self.start, "baseline")
        self._report(baseline, "")
        if baseline.result.error is not None:
            return SearchResult(baseline, Best(self.start, []), self.trials, False, self.threshold)
        self.threshold = noise_threshold(baseline.result.step_s, self.min_gain)
        best = Best(dict(self.start), list(baseline.result.step_s))
        out_of_budget = False
        for knob in self.knobs:
            if not self.budget.fits():
                out_of_budget = True
                break
            best, out_of_budget = self._search_knob(knob, best)
            if out_of_budget:
                break
        return SearchResult(baseline, best, self.trials, out_of_budget, self.threshold, self.notes)

    def _better(self, trial: Trial, best: Best) -> bool:
        return trial.median_s < best.median_s * (1 - self.threshold)

    def _trial(self, knob: Knob, base: Settings, value: int, label: str = "") -> tuple[Trial, Best]:
        """Run `base` with `knob` set to `value`."""
        settings = {**base, knob.name: value}
        old, new = format_value(knob.name, base[knob.name]), format_value(knob.name, value)
        trial = self._run(settings, f"{knob.name} {old} -> {new}{label}")
        return trial, Best(settings, list(trial.result.step_s))

    def _search_knob(self, knob: Knob, best: Best) -> tuple[Best, bool]:
        """Best after searching `knob`, and whether the budget ran out on the way."""
        before, start = best, best.settings[knob.name]
        # The grid: the measured candidates and GRID_STEPS ladder values either side of the start.
        values = [(v, " (auto)") for v in self.candidates.get(knob.name, [])]
        values += [(v, "") for v in knob.around(start, GRID_STEPS)]
        grid: list[tuple[Trial, Best]] = []
        out_of_budget = False
        for value, label in values:
            if value == start or any(b.settings[knob.name] == value for _, b in grid):
                continue
            if not self.budget.fits():
                out_of_budget = True
                break
            trial, candidate = self._trial(knob, before.settings, value, label)
            self._report(trial, "faster" if self._ok(trial) and self._better(trial, before) else "no gain")
            grid.append((trial, candidate))
        winners = [(t, b) for t, b in grid if self._ok(t) and self._better(t, before)]
        if winners:
            best = min(winners, key=lambda w: w[0].median_s)[1]
        elif out_of_budget or (best := self._second_look(knob, before, grid)) is None:
            return before, out_of_budget
        # Past the grid's edge: keep stepping the way the winner lies while each step is faster.
        value = best.settings[knob.name]
        direction = 1 if value > start else -1
        if not out_of_budget and all((v - value) * direction <= 0 for v, _ in values):
            best, out_of_budget = self._onward(knob, best, direction)
        return self._confirm(knob, before, best), out_of_budget

    def _second_look(self, knob: Knob, before: Best, grid: list[tuple[Trial, Best]]) -> Best | None:
        """The grid's fastest value run again, back to back with `before`, when the grid looks hit by load.

        A burst of load as long as the grid makes every value look slower than the start beyond the
        noise, which a knob's neighbours rarely all are: on a noisy machine (threshold at least
        SECOND_LOOK_NOISE) such a grid gets this second look. Returns the winner, or None. A grid about
        as fast as the start (a knob that does not matter) and a quiet machine cost nothing here.
        """
        ok = [(t, b) for t, b in grid if self._ok(t)]
        if self.threshold < SECOND_LOOK_NOISE or not ok or not self.budget.fits(2):
            return None
        fastest = min(ok, key=lambda w: w[0].median_s)
        if fastest[0].median_s * (1 - self.threshold) <= before.median_s:
            return None  # not all slower beyond the noise: the grid's answer stands
        value = fastest[1].settings[knob.name]
        look, candidate = self._trial(knob, before.settings, value, " (second look)")
        reference = self._run(
            before.settings, f"re-run {knob.name} = {format_value(knob.name, before.settings[knob.name])}"
        )
        won = self._ok(look) and (not self._ok(reference) or look.median_s < reference.median_s * (1 - self.threshold))
        self._report(look, "faster" if won else "no gain")
        self._report(reference, "reference")
        return candidate if won else None

    def _onward(self, knob: Knob, best: Best, direction: int) -> tuple[Best, bool]:
        """Step `knob` further in `direction` from `best` while each step is faster."""
        value = knob.next_value(best.settings[knob.name], direction)
        while value is not None:
            if not self.budget.fits():
                return best, True
            trial, candidate = self._trial(knob, best.settings, value)
            won = self._ok(trial) and self._better(trial, best)
            self._report(trial, "faster" if won else "no gain")
            if not won:
                break
            best, value = candidate, knob.next_value(value, direction)
        return best, False

    @staticmethod
    def _ok(trial: Trial) -> bool:
        return trial.result.error is None and bool(trial.result.step_s)

    def _confirm(self, knob: Knob, before: Best, best: Best) -> Best:
        """Run `best` and `before` again, back to back; keep `best` only if it is still faster.

        Back to back, both runs see the same load on the machine, so a drift in load between the
        trials that chose `best` cannot decide. The trial that chose it was one vote for it; if this
        pair votes against, a second pair breaks the tie (best of three), or, without the budget for
        it, the median of all steps run with either setting does. The last runs become the reference
        for the next knob.
        """
        old = format_value(knob.name, before.settings[knob.name])
        new = format_value(knob.name, best.settings[knob.name])
        for pair in range(CONFIRM_PAIRS):
            if not self.budget.fits(2):
                if pair == 0:
                    self.notes.append(f"{knob.name} = {new} kept on one run: no budget left to confirm it")
                    return best
                return self._pooled_decision(knob, before, best)
            again = self._run(best.settings, f"confirm {knob.name} = {new}")
            previous = self._run(before.settings, f"re-run {knob.name} = {old}")
            kept = self._ok(again) and (
                not self._ok(previous) or again.median_s < previous.median_s * (1 - self.threshold)
            )
            last = pair == CONFIRM_PAIRS - 1
            if kept:
                self._report(again, "confirmed")
                self._report(previous, "slower, as before")
                return Best(best.settings, again.result.step_s)
            self._report(again, f"not confirmed: back to {old}" if last else "not confirmed: once more")
            self._report(previous, "as fast")
        return Best(before.settings, previous.result.step_s if self._ok(previous) else before.step_s)

    def _pooled_decision(self, knob: Knob, before: Best, best: Best) -> Best:
        """Keep `best` if the median of all its steps beats the median of all of `before`'s."""
        new_s, old_s = self._steps(best.settings), self._steps(before.settings)
        kept = statistics.median(new_s) < statistics.median(old_s) * (1 - self.threshold)
        value = best.settings[knob.name] if kept else before.settings[knob.name]
        self.notes.append(
            f"{knob.name} = {format_value(knob.name, value)} chosen on all its runs so far "
            "(no budget left for a tie-breaking pair)"
        )
        return Best(best.settings, new_s) if kept else Best(before.settings, old_s)

    def _steps(self, settings: Settings) -> list[float]:
        return [
            t for trial in self.trials if trial.settings == settings and self._ok(trial) for t in trial.result.step_s
        ]
