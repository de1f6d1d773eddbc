"""The two summary pictures: where each step's time went (steps.png) and the slowest blocks (blocks.png)."""

from __future__ import annotations

import textwrap
from collections import defaultdict

from infinity.profiler import intervals as iv
from infinity.profiler.attribution import block_name
from infinity.profiler.breakdown import StepParts, breakdown
from infinity.profiler.format import COMPUTE, OTHER, PARTS, SERIAL_IO, STALL, kind_of_key
from infinity.profiler.plot_style import PART_COLOURS, figure
from infinity.profiler.traces import RankTrace
from infinity.profiler.verdict import MARGIN


def _segments(step: StepParts, ranks: int) -> list[tuple[str, str, float]]:
    """(phase, part, seconds per rank) bottom to top."""
    out = []
    for name, p in step.phases.items():
        values = {COMPUTE: p.compute_ns, STALL: p.stall_total_ns, SERIAL_IO: p.serial_io_ns, OTHER: p.other_ns}
        out += [(name, part, values[part] / ranks / 1e9) for part in PARTS]
    return out


def _title(diagnosis, width_in: float) -> str:
    """The verdict in a line or two: the largest avoidable part and its saving, or no change needed."""
    what = "where each step's time went: per phase (forward, backward, optimizer, bottom to top)"
    if diagnosis is None:
        return what
    limit = diagnosis.bound
    if diagnosis.findings:
        f = diagnosis.findings[0]
        p = f.prediction
        first = (
            f"largest avoidable part: {f.part} ({f.time_s / p.step_s:.0%} of the step); "
            f"expected saving {p.saving_s:.2f} s per step ({p.saving_s / p.step_s:.0%})"
        )
    elif limit is not None and diagnosis.verdict.startswith("no change needed") and diagnosis.breakdown is not None:
        step_s = diagnosis.breakdown.mean.wall_ns / 1e9
        first = f"no change needed: the {step_s:.2f} s step is within {MARGIN:.0%} of its {limit.kind} bound"
        first += f" {limit.bound_s:.2f} s"
    else:
        first = diagnosis.verdict.split(";")[0]
    return "\n".join(textwrap.wrap(first, int(11 * width_in))[:2] + [what])


def plot_steps(traces: list[RankTrace], path: str, diagnosis=None) -> str:
    """One stacked bar per step and one for the mean step: each phase's compute, stall, serial I/O and other."""
    b = diagnosis.breakdown if diagnosis is not None and diagnosis.breakdown is not None else breakdown(traces)
    bars = [(str(s.step), _segments(s, b.ranks)) for s in b.steps]
    bars.append(("mean", _segments(b.mean, 1)))
    fig, ax = figure(height=5.0, width=max(8.0, min(16.0, 4 + 0.5 * len(bars))))
    xs = [float(i) for i in range(len(bars) - 1)] + [len(bars) - 0.5]  # the mean stands apart
    top = 0.0
    for x, (_, segments) in zip(xs, bars, strict=True):
        bottom = 0.0
        last_phase = None
        for phase, part, seconds in segments:
            if phase != last_phase and last_phase is not None:
                ax.plot([x - 0.42, x + 0.42], [bottom, bottom], color="black", lw=1.2)
            last_phase = phase
            ax.bar(x, seconds, bottom=bottom, width=0.8, color=PART_COLOURS[part], edgecolor="white", lw=0.3)
            bottom += seconds
        top = max(top, bottom)
    # label the phases beside the mean bar, at the middle of each phase's stack
    bottom = 0.0
    for phase in dict.fromkeys(p for p, _, _ in bars[-1][1]):
        height = sum(s for p, _, s in bars[-1][1] if p == phase)
        if height > 0.02 * top:
            ax.annotate(phase, (xs[-1] + 0.45, bottom + height / 2), va="center", fontsize=9)
        bottom += height
    if diagnosis is not None and diagnosis.bound is not None:
        bound = diagnosis.bound
        ax.axhline(bound.bound_s, ls="--", color="black", lw=1)
        ax.annotate(
            f"bound {bound.bound_s:.2f} s ({bound.kind})",
            (xs[0] - 0.4, bound.bound_s),
            va="bottom",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
        )
    ax.set_xticks(xs, [label for label, _ in bars])
    ax.set_xlim(-0.6, xs[-1] + 1.5)
    ax.set(xlabel="step", ylabel="seconds per rank")
    ax.set_title(_title(diagnosis, fig.get_figwidth()), fontsize=10)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=PART_COLOURS[p], label=p) for p in PARTS], loc="upper left", ncols=4, fontsize=9)
    ax.set_ylim(0, top * 1.18 if top else 1)
    fig.savefig(path, dpi=110)
    return path


BLOCK_PARTS = ("compute", "parameter I/O", "optimizer I/O", "stall")


def block_times(traces: list[RankTrace]) -> dict[str, dict[str, float]]:
    """block -> BLOCK_PARTS: seconds per step per rank; I/O is the union of the block's moves in flight, of
    its parameters, and of its optimizer state and gradients."""
    totals: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(BLOCK_PARTS, 0.0))
    rank_steps = sum(len(t.steps()) for t in traces) or 1
    for trace in traces:
        moves: dict[tuple[str, str], list[iv.Span]] = defaultdict(list)
        for r in trace.of("move"):
            part = "parameter I/O" if kind_of_key(r["key"]) == "param" else "optimizer I/O"
            moves[(block_name(r["block"]), part)].append((r["start_ns"], r["end_ns"]))
        for (block, part), spans in moves.items():
            totals[block][part] += iv.length(iv.merge(spans)) / 1e9
        for kind, part in (("compute", "compute"), ("stall", "stall")):
            for r in trace.of(kind):
                totals[block_name(r["block"])][part] += (r["end_ns"] - r["start_ns"]) / 1e9
    return {b: {k: v / rank_steps for k, v in t.items()} for b, t in totals.items()}


def plot_blocks(traces: list[RankTrace], path: str, top: int = 12) -> str:
    """The `top` slowest blocks (compute + stall), slowest first: compute, I/O and stall per step."""
    times = block_times(traces)
    slowest = sorted(times, key=lambda b: -(times[b]["compute"] + times[b]["stall"]))[:top]
    slowest = [b for b in slowest if times[b]["compute"] + times[b]["stall"] > 0] or slowest
    fig, ax = figure(height=max(2.5, 0.42 * len(slowest) + 1.4))
    colours = {"compute": PART_COLOURS[COMPUTE], "parameter I/O": "#1e88e5", "optimizer I/O": "#90caf9"}
    colours["stall"] = PART_COLOURS[STALL]
    for row, block in enumerate(slowest):
        t = times[block]
        for y, part, left, label in (
            (row - 0.27, "compute", 0.0, "compute"),
            (row, "parameter I/O", 0.0, "parameter I/O"),
            (row, "optimizer I/O", t["parameter I/O"], "optimizer state and gradient I/O"),
            (row + 0.27, "stall", 0.0, "stall"),
        ):
            name = label if row == 0 else None  # one legend entry per part
            ax.barh(y, t[part], left=left, height=0.26, color=colours[part], label=name)
    ax.set_yticks(range(len(slowest)), slowest)
    ax.set_ylim(len(slowest) - 0.5, -0.5)
    ax.set(
        xlabel="seconds per step and rank",
        title=f"the {len(slowest)} slowest blocks: compute vs I/O in flight vs stall",
    )
    if slowest:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.savefig(path, dpi=110)
    return path
