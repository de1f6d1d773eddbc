"""The swap-profile report: load all ranks' traces, summarize, diagnose, and write the artifacts.

`build_report(paths, out_dir)` returns a `Report` whose `text` is what `tools/swap_profile.py` and
`infinity profile` print: the diagnosis first (the verdict on the whole step, its avoidable parts
with a what-if for each, the settings to change), then the step breakdown, memory, and the tables.
With `out_dir` it also writes `trace.perfetto.json` (open it in ui.perfetto.dev), `summary.json`,
and the PNGs of `plots` (when matplotlib is installed; otherwise a note in the text says so).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from infinity.profiler.accounting import Accounting, account
from infinity.profiler.analysis import ALL, Summary, Window, drop_malformed, summarize, validate
from infinity.profiler.attribution import attribute_stalls
from infinity.profiler.breakdown import StepParts
from infinity.profiler.diagnosis import Diagnosis, diagnose
from infinity.profiler.format import COLLECTIVE_OPS
from infinity.profiler.perfetto import write_perfetto
from infinity.profiler.plots import PlotsUnavailable, write_plots
from infinity.profiler.traces import RankTrace, load_traces

RATES_NOTE = (
    'GB/s "busy" = bytes / time the pair had a move in flight (union of move spans); '
    'GB/s "wall" = bytes / the window\'s wall time.\nTimes, bytes, op counts and rates are per rank (sums over '
    "ranks, divided); peaks are the highest rank's; GB = 1e9 bytes."
)


PAIR_ORDER = ("nvme->host", "host->device", "nvme->device", "device->host", "host->nvme", "device->nvme")


@dataclass
class Report:
    summary: Summary
    diagnosis: Diagnosis
    problems: list[str]  # from analysis.validate; malformed records were left out of the numbers
    accounting: Accounting = field(default_factory=Accounting)
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    text: str = ""


def prepare(traces: list[RankTrace]) -> list[str]:
    """Validate, drop malformed records and attribute stalls to what they waited on; the problems found."""
    problems = validate(traces)
    drop_malformed(traces)
    attribute_stalls(traces)
    return problems


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _window_lines(w: Window, label: str, indent: str = "  ") -> list[str]:
    hit = "-" if w.hit_rate is None else f"{w.hits}/{w.uses} ({100 * w.hit_rate:.0f}%)"
    peak = ", ".join(f"{tier} {_gb(b)}" for tier, b in sorted(w.peak_live.items())) or "-"
    per_rank = max(w.ranks, 1)
    lines = [
        f"{indent}{label:<10} {_ms(w.wall_ns / per_rank):>10} {_ms(w.stall_ns / per_rank):>10} "
        f"{100 * w.stall_share:>7.1f}%  {hit:<14} {peak}"
    ]
    waits = ", ".join(f"{k} {_ms(v / per_rank)} ms" for k, v in sorted(w.stall_by_wait.items(), key=lambda kv: -kv[1]))
    if waits:
        lines.append(f"{indent}    stalled on: {waits}")
    order = {name: i for i, name in enumerate(PAIR_ORDER + COLLECTIVE_OPS)}
    rates = sorted(w.moves.items(), key=lambda kv: order.get(kv[0], len(order)))
    rates += sorted(w.collectives.items(), key=lambda kv: order.get(kv[0], len(order)))
    for name, rate in rates:
        lines.append(
            f"{indent}    {name:<15} {_gb(rate.bytes / per_rank):>11} in {_count(rate.count / per_rank):>5} ops   "
            f"{rate.gbps_busy:7.2f} GB/s busy   {rate.gbps_wall:7.2f} GB/s wall"
        )
    return lines


def _count(mean: float) -> str:
    return f"{mean:.0f}" if mean == int(mean) else f"{mean:.1f}"


HEADER = f"  {'phase':<10} {'wall ms':>10} {'stall ms':>10} {'stall':>8}  {'prefetch hit':<14} peak live"
PARTS_HEADER = (
    f"  {'phase':<10} {'wall s':>8} {'compute':>8} {'stall':>8} {'serial I/O':>10} {'other':>8}"
    f" {'NVMe read':>10} {'written':>10}  stalled on"
)


def _parts_lines(mean: StepParts) -> list[str]:
    lines = []
    for name, p in mean.phases.items():
        waits = ", ".join(f"{g} {ns / 1e9:.3f}" for g, ns in sorted(p.stall_ns.items(), key=lambda kv: -kv[1]))
        lines.append(
            f"  {name:<10} {p.wall_ns / 1e9:8.3f} {p.compute_ns / 1e9:8.3f} {p.stall_total_ns / 1e9:8.3f} "
            f"{p.serial_io_ns / 1e9:10.3f} {p.other_ns / 1e9:8.3f} {_gb(p.nvme('read')):>10} "
            f"{_gb(p.nvme('write')):>10}  {waits or '-'}"
        )
    return lines


def _diagnosis_lines(d: Diagnosis, notes: list[str]) -> list[str]:
    out = ["diagnosis:", f"  {d.verdict}"]
    if d.findings:
        out.append("  avoidable parts, largest saving first:")
        for i, f in enumerate(d.findings, 1):
            out += [f"  {i}. {f.headline}", f"     removed by: {f.remedy}", f"     what-if: {f.prediction}"]
    if d.recommendations:
        out.append("  settings to change (each changes this run's budgets or I/O):")
        out += [f"  - {r}" for r in d.recommendations]
    out += [f"  note: {n}" for n in d.notes + notes]
    return out


def _memory_lines(acc: Accounting) -> list[str]:
    out = ["memory (the highest rank's peaks):"]
    for tier in sorted(set(acc.live_peak) | set(acc.store_peak)):
        store = f" (store high-water {_gb(acc.store_peak[tier])})" if tier in acc.store_peak else ""
        held = acc.held_peak.get(tier, {})
        parts = ", ".join(f"{h} {_gb(b)}" for h, b in sorted(held.items(), key=lambda kv: -kv[1]) if b)
        held_text = f"; held for {parts}" if parts else ""
        out.append(f"  {tier:<7} live {_gb(acc.live_peak.get(tier, 0))}{store}{held_text}")
    if acc.rss_peak is not None:
        out.append(
            f"  process RSS {_gb(acc.rss_start)} at the first step, {_gb(acc.rss_peak)} at most "
            f"(+{_gb(acc.rss_peak - acc.rss_start)}, sampled at phase changes)"
        )
    return out if len(out) > 1 else []


def format_report(report: Report, traces: list[RankTrace]) -> str:
    s, d = report.summary, report.diagnosis
    crashed = [st.step for st in s.steps if not st.total.complete]
    steps = f"{s.steps[0].step}..{s.steps[-1].step}" if s.steps else "none"
    out = [
        f"infinity swap profile: {len(s.ranks)} rank(s) of world size {s.world_size}, "
        f"{len(s.steps)} step(s) ({steps})" + (f", step(s) {crashed} cut short" if crashed else "")
    ]
    out += [f"  {t.path}" + ("  (last line cut: the run crashed)" if t.truncated else "") for t in traces]
    out += [""] + _diagnosis_lines(d, report.notes + report.accounting.problems()) + [""]
    b = d.breakdown
    if b is not None and b.rank_steps:
        out += [f"step breakdown: mean step per rank over {b.rank_steps} rank-step(s), seconds", PARTS_HEADER]
        out += _parts_lines(b.mean)
        bound = f"; bound {d.bound}" if d.bound is not None else ""
        out += [f"  {'step':<10} {b.mean.wall_ns / 1e9:8.3f}{bound}", ""]
    out += _memory_lines(report.accounting)
    out += ["", RATES_NOTE, ""]
    for st in s.steps:
        out += [f"step {st.step}" + ("" if st.total.complete else " (incomplete)"), HEADER]
        for phase, w in st.phases.items():
            out += _window_lines(w, phase)
        out += [*_window_lines(st.total, "step"), ""]
    out += ["all steps", HEADER]
    for phase, w in s.phases.items():
        out += _window_lines(w, phase)
    out += _window_lines(s.total, ALL)
    out += ["", "slowest blocks (mean compute per call):"]
    out += [
        f"  {b.block:<24} {b.phase:<9} {_ms(b.mean_ns):>8} ms mean {_ms(b.max_ns):>8} ms max  {b.count} calls"
        for b in s.slowest_compute
    ] or ["  (no compute spans recorded)"]
    out += ["most stalled blocks (total stall):"]
    out += [
        f"  {b.block:<24} {b.phase:<9} {_ms(b.total_ns):>8} ms in {b.count} stalls  on "
        + ", ".join(f"{k} {_ms(v)} ms" for k, v in sorted(b.waited_on.items(), key=lambda kv: -kv[1]))
        for b in s.most_stalled
    ] or ["  (no stalls recorded)"]
    if s.pools:
        out += [
            "buffer pools: "
            + "; ".join(f"'{p}' exhausted {c} times, waited {w / 1e9:.3f} s" for p, (c, w) in sorted(s.pools.items()))
        ]
    if report.problems:
        out += ["", f"trace problems ({len(report.problems)}; malformed records left out):"]
        out += [f"  {p}" for p in report.problems]
    if report.files:
        out += ["", "written:"] + [f"  {f}" for f in report.files]
    return "\n".join(out)


_DERIVED = ("gbps_busy", "gbps_wall", "stall_share", "hit_rate", "other_ns", "stall_total_ns", "bound_s", "saving_s")


def _jsonable(obj: object) -> dict:
    """A dataclass as JSON-able data, with its derived properties (rates, shares, the bound)."""

    def convert(obj):
        if dataclasses.is_dataclass(obj):
            fields = {f.name: convert(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            return {**fields, **{name: getattr(obj, name) for name in _DERIVED if hasattr(obj, name)}}
        if isinstance(obj, dict):
            return {str(k) if not isinstance(k, tuple) else "/".join(k): convert(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [convert(v) for v in obj]
        if isinstance(obj, set):
            return sorted(obj)
        return obj

    return convert(obj)


def build_report(
    paths: list[str | os.PathLike], out_dir: str | os.PathLike | None = None, plots: bool = True, top: int = 5
) -> Report:
    """Read the traces (files, or directories of trace_rank*.jsonl) and build the report; see the module doc."""
    traces = load_traces(paths)
    if not traces:
        raise ValueError("no traces given")
    problems = prepare(traces)
    summary = summarize(traces, top=top)
    report = Report(summary, diagnose(summary, traces), problems, account(traces))
    if out_dir is not None:
        out = os.fspath(out_dir)
        os.makedirs(out, exist_ok=True)
        report.files.append(write_perfetto(traces, os.path.join(out, "trace.perfetto.json")))
        summary_path = os.path.join(out, "summary.json")
        with open(summary_path, "w", encoding="utf-8") as f:
            diagnosis = _jsonable(report.diagnosis)
            diagnosis["findings"] = [
                {**_jsonable(x), "headline": x.headline, "saving_s": x.prediction.saving_s}
                for x in report.diagnosis.findings
            ]
            json.dump(
                {
                    "summary": _jsonable(summary),
                    "diagnosis": diagnosis,
                    "accounting": _jsonable(report.accounting),
                    "problems": problems,
                },
                f,
                indent=1,
            )
        report.files.append(summary_path)
        if plots:
            try:
                report.files += write_plots(traces, out, report.diagnosis)
            except PlotsUnavailable as exc:
                report.notes.append(str(exc))
    report.text = format_report(report, traces)
    return report
