"""PNG plots of swap traces with matplotlib (the `plots` extra), drawn without a display (Agg).

In the order a person reads them:
- steps.png: one stacked bar per step (and the mean step): compute, stall, serial I/O and other time
  of each phase, the step's bound as a dashed line, the verdict as the title (`plots_steps`).
- timeline.png: GB/s per tier pair over time with the phases shaded, and below it a row per rank
  with its compute and its stalls coloured by what they waited on.
- blocks.png: the slowest blocks, a row each: compute, I/O in flight and stall per step (`plots_steps`).
- live_bytes.png: live bytes per tier over time (host split by holder when recorded), the store's
  high-water mark dashed, the phases shaded.
Time is seconds on the shared timeline from the first step's start.
"""

from __future__ import annotations

import os
from collections import defaultdict

from infinity.profiler.format import tier_pair, wait_group
from infinity.profiler.plot_style import PART_COLOURS, PlotsUnavailable, figure
from infinity.profiler.plots_steps import plot_blocks, plot_steps
from infinity.profiler.traces import RankTrace

__all__ = ["PART_COLOURS", "PlotsUnavailable", "figure", "write_plots"]

PHASE_COLOURS = {"forward": "#dbe9f6", "backward": "#dcefd9", "optimizer": "#fde3c8"}
WAIT_COLOURS = {
    "disk read": "#e53935",
    "disk write": "#8e24aa",
    "host-to-device copy": "#1e88e5",
    "device-to-host copy": "#00897b",
    "collective": "#fdd835",
    "gradient reduction": "#c0ca33",
    "buffer pool": "#6d4c41",
    "optimizer step": "#fb8c00",
}
PAIR_COLOURS = {
    "nvme->host": "#e53935",
    "host->nvme": "#8e24aa",
    "host->device": "#1e88e5",
    "device->host": "#00897b",
    "nvme->device": "#f4511e",
    "device->nvme": "#5e35b1",
}


def origin_ns(traces: list[RankTrace]) -> int:
    starts = [t.to_global(s) for t in traces for s, _, _ in t.steps().values()]
    return min(starts) if starts else 0


def shade_phases(ax, trace: RankTrace, origin: int, label: bool = False) -> None:
    """Shade `trace`'s phase spans on `ax` (seconds from `origin`); `label` names them once in the legend."""
    named: set[str] = set()
    for (_, phase), spans in sorted(trace.phase_spans().items()):
        for start, end in spans:
            legend = phase if label and phase not in named else None
            named.add(phase)
            ax.axvspan(
                (trace.to_global(start) - origin) / 1e9,
                (trace.to_global(end) - origin) / 1e9,
                color=PHASE_COLOURS.get(phase, "#eeeeee"),
                zorder=0,
                lw=0,
                label=legend,
            )


def bandwidth_bins(traces: list[RankTrace], bins: int = 100) -> tuple[float, dict[str, list[float]]]:
    """(bin width in s, tier pair -> GB/s in each bin) over all ranks, from the first step's start."""
    origin = origin_ns(traces)
    moves = [
        (
            tier_pair(r["src"], r["dst"]),
            t.to_global(r["start_ns"]) - origin,
            t.to_global(r["end_ns"]) - origin,
            r["bytes"],
        )
        for t in traces
        for r in t.of("move")
    ]
    span = max(
        [e for _, _, e, _ in moves] + [t.to_global(e) - origin for t in traces for _, e, _ in t.steps().values()] + [1]
    )
    width = span / bins
    series: dict[str, list[float]] = defaultdict(lambda: [0.0] * bins)
    for pair, start, end, nbytes in moves:
        start = max(start, 0)
        first, last = min(int(start // width), bins - 1), min(int(end // width), bins - 1)
        for i in range(first, last + 1):
            if end <= start:
                share = 1.0
            else:
                share = (min(end, (i + 1) * width) - max(start, i * width)) / (end - start)
            series[pair][i] += nbytes * max(share, 0.0)
    return width / 1e9, {pair: [b / width for b in values] for pair, values in series.items()}  # bytes/ns = GB/s


def _bar(trace: RankTrace, r: dict, origin: int) -> tuple[float, float]:
    """(start s on the shared timeline, duration s) of span record `r`."""
    return (trace.to_global(r["start_ns"]) - origin) / 1e9, (r["end_ns"] - r["start_ns"]) / 1e9


def plot_timeline(traces: list[RankTrace], path: str) -> str:
    """Bandwidth per tier pair with phases shaded; below, per rank: compute and stalls by what was waited on."""
    origin = origin_ns(traces)
    width_s, series = bandwidth_bins(traces, bins=200)
    fig, (top, bottom) = figure(height=6.0, rows=2, ratios=[2.2, max(1.0, 0.45 * len(traces) + 0.6)])
    shade_phases(top, traces[0], origin, label=True)
    for pair, values in sorted(series.items()):
        xs = [(i + 0.5) * width_s for i in range(len(values))]
        top.plot(xs, values, label=pair, drawstyle="steps-mid", color=PAIR_COLOURS.get(pair), lw=1.4)
    rank = f"phases of rank {traces[0].rank}" if len(traces) > 1 else "phases shaded"
    top.set(ylabel="GB/s", title=f"bandwidth per tier pair, all ranks ({width_s * 1e3:.0f} ms bins; {rank})")
    top.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    top.set_ylim(bottom=0)
    seen: dict[str, str] = {}
    for row, trace in enumerate(traces):
        for (_, phase), spans in trace.phase_spans().items():
            bars = [((trace.to_global(s) - origin) / 1e9, (e - s) / 1e9) for s, e in spans]
            bottom.broken_barh(bars, (row - 0.45, 0.9), color=PHASE_COLOURS.get(phase, "#eeeeee"), zorder=0)
        compute = [_bar(trace, r, origin) for r in trace.of("compute")]
        bottom.broken_barh(compute, (row + 0.03, 0.32), color=PART_COLOURS["compute"])
        by_group: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in trace.of("stall"):
            group = wait_group(r["waited_on"])
            by_group[group].append(_bar(trace, r, origin))
        for group, bars in sorted(by_group.items()):
            seen[group] = WAIT_COLOURS.get(group, "#e53935")
            bottom.broken_barh(bars, (row - 0.35, 0.32), color=seen[group])
    bottom.set_yticks(range(len(traces)), [f"rank {t.rank}" for t in traces])
    bottom.set_ylim(len(traces) - 0.5, -0.5)
    bottom.set(xlabel="time (s)", title="per rank: compute (lower) and stalls by what was waited on (upper)")
    from matplotlib.patches import Patch

    handles = [Patch(color=PART_COLOURS["compute"], label="compute")]
    handles += [Patch(color=c, label=f"stall: {g}") for g, c in seen.items()]
    bottom.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def binned_max(points: list[tuple[int, int]], start: int, width: int, bins: int) -> list[float]:
    """The highest level of step function `points` [(t, value)] in each of `bins` bins from `start`, in
    units of 1e9 (the level carried into a bin counts; 0 before the first point): peaks stay visible."""
    out, level, j = [], 0, 0
    points = sorted(points, key=lambda p: p[0])  # ties keep file order: the last change at a time wins
    for i in range(bins):
        end = start + (i + 1) * width
        high = level
        while j < len(points) and points[j][0] < end:
            level = points[j][1]
            high = max(high, level)
            j += 1
        out.append(max(high, level) / 1e9)
    return out


def plot_live_bytes(traces: list[RankTrace], path: str, bins: int = 600) -> str:
    """Live bytes per tier (the highest level in each pixel-wide bin, so no peak is lost); the first rank's
    host split by holder when `held` records exist; the store's high-water marks dashed."""
    origin = origin_ns(traces)
    ends = [t.to_global(e) for t in traces for _, e, _ in t.steps().values()]
    width = max(1, ((max(ends) if ends else origin + 1) - origin) // bins)
    xs = [i * width / 1e9 for i in range(bins)]
    fig, ax = figure(height=4.5)
    shade_phases(ax, traces[0], origin)
    first = traces[0]
    held: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for r in first.of("held"):
        if r["tier"] == "host":
            held[r["holder"]].append((first.to_global(r["t_ns"]), r["bytes"]))
    if held:
        rows = [(h, binned_max(points, origin, width, bins)) for h, points in sorted(held.items())]
        ax.stackplot(xs, *[row for _, row in rows], labels=[f"host: {h}" for h, _ in rows], step="post", alpha=0.8)
    for trace in traces:
        for tier, points in sorted(trace.live_series().items()):
            level = binned_max([(trace.to_global(t), b) for t, b in points], origin, width, bins)
            ax.step(xs, level, where="post", label=f"rank {trace.rank} {tier} live", lw=1.3)
    peaks: dict[str, int] = {}
    for trace in traces:
        for r in trace.of("peak"):
            peaks[r["tier"]] = max(peaks.get(r["tier"], 0), r["bytes"])
    for tier, peak in sorted(peaks.items()):
        ax.axhline(peak / 1e9, ls="--", color="black", lw=1)
        label = f"store high-water ({tier}) {peak / 1e9:.2f} GB"
        ax.annotate(label, (0.01, peak / 1e9), xycoords=("axes fraction", "data"), va="bottom", fontsize=8)
    ax.set(xlabel="time (s)", ylabel="GB", title="live bytes per tier (highest level per bin; phases shaded)")
    ax.set_ylim(bottom=0)
    if ax.lines or ax.collections:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.savefig(path, dpi=110)
    return path


def write_plots(traces: list[RankTrace], out_dir: str | os.PathLike, diagnosis=None) -> list[str]:
    """Write the PNGs into `out_dir` (steps.png first); raises PlotsUnavailable without matplotlib."""
    out = os.fspath(out_dir)
    figure()  # fails here, before any file is written, without matplotlib
    return [
        plot_steps(traces, os.path.join(out, "steps.png"), diagnosis),
        plot_timeline(traces, os.path.join(out, "timeline.png")),
        plot_blocks(traces, os.path.join(out, "blocks.png")),
        plot_live_bytes(traces, os.path.join(out, "live_bytes.png")),
    ]
