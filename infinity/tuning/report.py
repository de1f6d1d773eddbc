"""How `infinity tune` shows its trials: one progress line per trial, and the table at the end."""

from __future__ import annotations

from infinity.tuning.knobs import format_value
from infinity.tuning.search import SearchResult, Settings, Trial


def _speedup(trial: Trial, baseline: Trial) -> str:
    if trial.result.error is not None or not trial.result.step_s:
        return "-"
    return f"{baseline.median_s / trial.median_s:.2f}x"


def _median(trial: Trial) -> str:
    return "-" if trial.result.error is not None or not trial.result.step_s else f"{trial.median_s:.4f}"


def progress_line(trial: Trial, baseline: Trial) -> str:
    """'trial 3  aio.queue_depth 1 -> 2  median 0.0612 s  1.43x  faster'."""
    verdict = f"  {trial.verdict}" if trial.verdict else ""
    return f"trial {trial.index:>2}  {trial.change}  median {_median(trial)} s  {_speedup(trial, baseline)}{verdict}"


def format_table(result: SearchResult) -> str:
    """The trials as a table: change, median step (s), speedup vs the baseline, verdict."""
    rows = [("trial", "settings changed", "median step s", "speedup", "verdict")]
    for t in result.trials:
        rows.append((str(t.index), t.change, _median(t), _speedup(t, result.baseline), t.verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for r in rows:
        cells = [r[0].rjust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2]), r[3].rjust(widths[3]), r[4]]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def describe_changes(start: Settings, best: Settings) -> str:
    """'aio.queue_depth 1 -> 16, aio.block_size 4 KiB -> 1 MiB', or 'no change'."""
    changed = [
        f"{name} {format_value(name, start[name])} -> {format_value(name, value)}"
        for name, value in best.items()
        if value != start[name]
    ]
    return ", ".join(changed) or "no change"
