"""PNG plots of swap traces with matplotlib (the `plots` extra), drawn without a display (Agg).

- bandwidth.png: GB/s per tier pair over time, all ranks together; each move's bytes are spread
  evenly over its span and summed into time bins.
- live_bytes.png: live bytes per tier over time, a line per rank and tier.
- stalls.png: when compute waited, a row per rank, coloured by what it waited on.
Time is seconds on the shared timeline from the first step's start.
"""

from __future__ import annotations

import os
from collections import defaultdict

from infinity.profiler.format import tier_pair
from infinity.profiler.traces import RankTrace


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _figure(height: float = 4.0):
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotsUnavailable(
            "matplotlib is not installed, so no PNG plots: pip install 'infinity[plots]' (or pip install matplotlib)"
        ) from exc
    fig = Figure(figsize=(10, height), layout="constrained")
    return fig, fig.add_subplot()


def _origin_ns(traces: list[RankTrace]) -> int:
    starts = [t.to_global(s) for t in traces for s, _, _ in t.steps().values()]
    return min(starts) if starts else 0


def bandwidth_bins(traces: list[RankTrace], bins: int = 100) -> tuple[float, dict[str, list[float]]]:
    """(bin width in s, tier pair -> GB/s in each bin) over all ranks, from the first step's start."""
    origin = _origin_ns(traces)
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


def plot_bandwidth(traces: list[RankTrace], path: str) -> str:
    width_s, series = bandwidth_bins(traces)
    fig, ax = _figure()
    for pair, values in sorted(series.items()):
        ax.plot([(i + 0.5) * width_s for i in range(len(values))], values, label=pair, drawstyle="steps-mid")
    ax.set(xlabel="time (s)", ylabel="GB/s", title=f"bandwidth per tier pair, all ranks ({width_s * 1e3:.1f} ms bins)")
    if series:
        ax.legend(loc="upper right")
    fig.savefig(path, dpi=100)
    return path


def plot_live_bytes(traces: list[RankTrace], path: str) -> str:
    origin = _origin_ns(traces)
    fig, ax = _figure()
    for trace in traces:
        for tier, points in sorted(trace.live_series().items()):
            xs = [(trace.to_global(t) - origin) / 1e9 for t, _ in points]
            ax.step(xs, [b / 1e9 for _, b in points], where="post", label=f"rank {trace.rank} {tier}")
    ax.set(xlabel="time (s)", ylabel="live GB", title="live bytes per tier")
    if ax.lines:
        ax.legend(loc="upper right")
    fig.savefig(path, dpi=100)
    return path


def plot_stalls(traces: list[RankTrace], path: str) -> str:
    origin = _origin_ns(traces)
    fig, ax = _figure(height=max(2.5, 0.6 * len(traces) + 1.5))
    colours: dict[str, str] = {}
    palette = ["tab:red", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:gray"]
    for row, trace in enumerate(traces):
        by_wait: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in trace.of("stall"):
            by_wait[r["waited_on"]].append(
                ((trace.to_global(r["start_ns"]) - origin) / 1e9, (r["end_ns"] - r["start_ns"]) / 1e9)
            )
        for wait, bars in sorted(by_wait.items()):
            colour = colours.setdefault(wait, palette[len(colours) % len(palette)])
            ax.broken_barh(bars, (row - 0.4, 0.8), color=colour)
    ax.set_yticks(range(len(traces)), [f"rank {t.rank}" for t in traces])
    ax.set(xlabel="time (s)", title="stalls: compute waiting for a block")
    if colours:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=c, label=w) for w, c in colours.items()], loc="upper right")
    fig.savefig(path, dpi=100)
    return path


def write_plots(traces: list[RankTrace], out_dir: str | os.PathLike) -> list[str]:
    """Write the three PNGs into `out_dir`; raises PlotsUnavailable without matplotlib."""
    out = os.fspath(out_dir)
    return [
        plot(traces, os.path.join(out, name))
        for plot, name in (
            (plot_bandwidth, "bandwidth.png"),
            (plot_live_bytes, "live_bytes.png"),
            (plot_stalls, "stalls.png"),
        )
    ]
