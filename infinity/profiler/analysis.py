"""The numbers of a swap profile: validation and the summary per step and phase, across ranks.

Bandwidth definitions (GB = 1e9 bytes; bytes per nanosecond are GB/s):
- busy GB/s of a tier pair = bytes / the union of its moves' spans (time the pair had a move in flight);
- wall GB/s = bytes / the window's wall time (the step, or the sum of the phase's spans).
Per-rank quantities are summed over ranks before dividing, so rates are per-rank averages weighted by
time; peaks of live bytes are the maximum over ranks.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from infinity.profiler import intervals as iv
from infinity.profiler.format import (
    COLLECTIVE_OPS,
    FIELDS,
    HOLDERS,
    PHASES,
    POOL_EVENTS,
    QUEUE_STREAMS,
    READABLE_VERSIONS,
    TIERS,
    WAIT_KINDS,
    tier_pair,
)
from infinity.profiler.traces import RankTrace, Record

ALL = "all"  # the step or phase name of an aggregate window
NON_OVERLAPPING = ("step", "phase", "compute", "stall")


# -- validation ------------------------------------------------------------------------------------


def record_problem(r: Record) -> str | None:
    """Why record `r` is malformed, or None (unknown record types are fine: readers skip them)."""
    fields = FIELDS.get(r.get("type"))
    if fields is None:
        return None
    for name, kind in fields.items():
        value = r.get(name)
        if value is None or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"{r['type']} record has {name}={value!r}, needs {getattr(kind, '__name__', kind)}"
    checks = [
        ("end_ns" in fields and r["end_ns"] < r["start_ns"], "ends before it starts"),
        ("phase" in fields and r["type"] != "meta" and r["phase"] not in PHASES, f"unknown phase {r.get('phase')!r}"),
        ("bytes" in fields and r["bytes"] < 0, "negative bytes"),
        (
            r["type"] == "move" and (r["src"] not in TIERS or r["dst"] not in TIERS or r["src"] == r["dst"]),
            f"bad tiers {r.get('src')!r}->{r.get('dst')!r}",
        ),
        (r["type"] in ("live", "held", "peak") and r["tier"] not in TIERS, f"unknown tier {r.get('tier')!r}"),
        (r["type"] == "held" and r["holder"] not in HOLDERS, f"unknown holder {r.get('holder')!r}"),
        (r["type"] == "stall" and r["waited_on"] not in WAIT_KINDS, f"unknown waited_on {r.get('waited_on')!r}"),
        (r["type"] == "collective" and r["op"] not in COLLECTIVE_OPS, f"unknown op {r.get('op')!r}"),
        (r["type"] == "queue" and (r["stream"] not in QUEUE_STREAMS or r["depth"] < 0), "bad stream or depth"),
        (r["type"] == "pool" and (r["event"] not in POOL_EVENTS or r["wait_ns"] < 0), "bad pool event"),
    ]
    for failed, why in checks:
        if failed:
            return f"{r['type']} record {why}"
    return None


def validate(traces: Iterable[RankTrace], limit: int = 50) -> list[str]:
    """Problems of the traces (empty when well formed), at most `limit` of them.

    Checks: the meta line's version; every record's required fields, types, known tiers / phases /
    ops / streams / holders, end >= start; per rank, that spans of each of step, phase, compute and
    stall do not overlap one another (touching is fine); and that a one-rank trace has no collective
    (none happens: a collective over one rank is a view), neither as a record nor as what a stall
    waited on. Moves and collectives may overlap (requests in flight together).
    """
    problems: list[str] = []
    for trace in traces:
        where = f"rank {trace.rank} ({trace.path})"
        if trace.meta.get("version") not in READABLE_VERSIONS:
            problems.append(
                f"{where}: format version {trace.meta.get('version')!r}, this reader knows {READABLE_VERSIONS}"
            )
        if problem := record_problem(trace.meta):
            problems.append(f"{where}: {problem}")
        for records in trace.records.values():
            for r in records:
                if problem := record_problem(r):
                    problems.append(f"{where}: {problem}: {r}")
        if int(trace.meta.get("world_size", 0)) == 1:
            waits = [r for r in trace.of("stall") if r.get("waited_on") in COLLECTIVE_OPS]
            if trace.of("collective") or waits:
                problems.append(
                    f"{where}: a one-rank trace has {len(trace.of('collective'))} collective record(s) and "
                    f"{len(waits)} stall(s) on a collective; at one rank nothing is communicated"
                )
        for kind in NON_OVERLAPPING:
            spans = sorted((r["start_ns"], r["end_ns"]) for r in trace.of(kind) if record_problem(r) is None)
            for (s0, e0), (s1, e1) in zip(spans, spans[1:], strict=False):
                if s1 < e0:
                    problems.append(f"{where}: {kind} spans overlap: [{s0}, {e0}] and [{s1}, {e1}]")
    if len(problems) > limit:
        problems = problems[:limit] + [f"... and {len(problems) - limit} more"]
    return problems


def drop_malformed(traces: Iterable[RankTrace]) -> int:
    """Remove malformed records so the analysis can trust fields; returns how many were removed."""
    dropped = 0
    for trace in traces:
        for kind, records in trace.records.items():
            kept = [r for r in records if record_problem(r) is None]
            dropped += len(records) - len(kept)
            trace.records[kind] = kept
    return dropped


def bytes_by_pair(traces: Iterable[RankTrace]) -> dict[str, int]:
    """Bytes moved per tier pair over all ranks, for comparing against the store's own counts."""
    moved: dict[str, int] = defaultdict(int)
    for trace in traces:
        for r in trace.of("move"):
            moved[tier_pair(r["src"], r["dst"])] += r["bytes"]
    return dict(moved)


# -- intervals -------------------------------------------------------------------------------------


def union_ns(spans: Iterable[tuple[int, int]]) -> int:
    """Nanoseconds covered by the union of [start, end] spans."""
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(spans):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0)


def peak_in(series: list[tuple[int, int]], spans: Iterable[tuple[int, int]]) -> int | None:
    """The highest value of a step function [(t, value)] within `spans` (its level at each start counts)."""
    times = [t for t, _ in series]
    peak = None
    for start, end in spans:
        lo, hi = bisect.bisect_right(times, start), bisect.bisect_right(times, end)
        values = [v for _, v in series[max(lo - 1, 0) : hi]]  # the level at start, then changes up to end
        if values:
            peak = max(values) if peak is None else max(peak, *values)
    return peak


def covered_below(series: list[tuple[int, int]], spans: Iterable[tuple[int, int]], threshold: int) -> tuple[int, int]:
    """(ns within `spans` when the step function is below `threshold`, ns of `spans`); level 0 before its start."""
    times = [t for t, _ in series]
    below = total = 0
    for start, end in spans:
        total += end - start
        t, level = start, 0
        i = bisect.bisect_right(times, start)
        if i:
            level = series[i - 1][1]
        for when, value in series[i:]:
            if when >= end:
                break
            below += (when - t) if level < threshold else 0
            t, level = when, value
        below += (end - t) if level < threshold else 0
    return below, total


def depth_series(trace: RankTrace, stream: str) -> tuple[list[tuple[int, int]], bool]:
    """The queue depth of `stream` over time; (series, measured). Without `queue` records it is the
    number of NVMe moves in flight (a lower bound of requests in flight), and `measured` is False."""
    points = sorted((r["t_ns"], r["depth"]) for r in trace.of("queue") if r["stream"] == stream)
    if points:
        return points, True
    read = stream == "nvme-read"
    edges: list[tuple[int, int]] = []
    for r in trace.of("move"):
        if (r["src"] if read else r["dst"]) == "nvme":
            edges += [(r["start_ns"], 1), (r["end_ns"], -1)]
    depth, series = 0, []
    for t, delta in sorted(edges, key=lambda e: (e[0], e[1])):
        depth += delta
        series.append((t, depth))
    return series, False


# -- the summary -----------------------------------------------------------------------------------


@dataclass
class Rate:
    """Bytes of one tier pair or collective op in a window, with the time they were in flight."""

    bytes: int = 0
    count: int = 0
    busy_ns: int = 0  # union of spans, summed over ranks
    wall_ns: int = 0  # the window's wall time, summed over ranks

    @property
    def gbps_busy(self) -> float:
        return self.bytes / self.busy_ns if self.busy_ns else 0.0

    @property
    def gbps_wall(self) -> float:
        return self.bytes / self.wall_ns if self.wall_ns else 0.0


@dataclass
class Window:
    """One step and phase ("all" for aggregates), summed over the ranks that ran it."""

    step: int | str
    phase: str
    ranks: int = 0
    wall_ns: int = 0
    stall_ns: int = 0
    stall_by_wait: dict[str, int] = field(default_factory=dict)
    uses: int = 0
    hits: int = 0
    moves: dict[str, Rate] = field(default_factory=dict)  # tier pair -> rate
    collectives: dict[str, Rate] = field(default_factory=dict)  # op -> rate
    peak_live: dict[str, int] = field(default_factory=dict)  # tier -> max over ranks
    complete: bool = True

    @property
    def stall_share(self) -> float:
        return self.stall_ns / self.wall_ns if self.wall_ns else 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.uses if self.uses else None

    @property
    def mean_wall_ns(self) -> float:
        return self.wall_ns / self.ranks if self.ranks else 0.0


@dataclass
class BlockStat:
    """A block's compute or stall time in one phase, over all steps and ranks."""

    block: str
    phase: str
    total_ns: int = 0
    count: int = 0
    max_ns: int = 0
    waited_on: dict[str, int] = field(default_factory=dict)  # stalls only: ns per cause

    @property
    def mean_ns(self) -> float:
        return self.total_ns / self.count if self.count else 0.0


@dataclass
class StepSummary:
    step: int
    total: Window  # the whole step
    phases: dict[str, Window]


@dataclass
class Summary:
    """Everything the report prints, per step and phase and in aggregate ("all")."""

    ranks: list[int]
    world_size: int
    settings: dict
    raw_disk: dict | None
    steps: list[StepSummary]
    phases: dict[str, Window]  # each phase over all steps
    total: Window  # all steps
    slowest_compute: list[BlockStat]  # by mean compute per call
    most_stalled: list[BlockStat]  # by total stall
    pools: dict[str, tuple[int, int]]  # pool -> (times exhausted, ns waited)
    truncated: list[str]  # files whose last line was cut


_Bucket = dict[str, list[Record]]
_EVENT_KINDS = ("move", "stall", "collective", "use", "compute")


def _buckets(trace: RankTrace) -> dict[tuple[int, str], _Bucket]:
    buckets: dict[tuple[int, str], _Bucket] = defaultdict(lambda: {k: [] for k in _EVENT_KINDS})
    for kind in _EVENT_KINDS:
        for r in trace.of(kind):
            buckets[(r["step"], r["phase"])][kind].append(r)
    return buckets


def _add(window: Window, groups: list[_Bucket], wall_spans: list[tuple[int, int]], live: dict) -> None:
    """Add one rank's events of `groups`, whose window spans `wall_spans`, to `window`."""
    wall = sum(e - s for s, e in wall_spans)
    window.ranks += 1
    window.wall_ns += wall
    inside = iv.merge(wall_spans)
    spans: dict[tuple[str, str], list[tuple[int, int]]] = defaultdict(list)
    for g in groups:
        for r in g["stall"]:
            # the part inside the window: a last deferred step settled after the last step's end (before a
            # checkpoint) carries that step's optimizer phase, but ran after it closed
            ns = iv.overlap_ns((r["start_ns"], r["end_ns"]), inside)
            if not ns:
                continue
            window.stall_ns += ns
            window.stall_by_wait[r["waited_on"]] = window.stall_by_wait.get(r["waited_on"], 0) + ns
        for r in g["use"]:
            window.uses += 1
            window.hits += bool(r["ready"])
        for kind, name_of in (("move", lambda r: tier_pair(r["src"], r["dst"])), ("collective", lambda r: r["op"])):
            rates = window.moves if kind == "move" else window.collectives
            for r in g[kind]:
                rate = rates.setdefault(name_of(r), Rate())
                rate.bytes += r["bytes"]
                rate.count += 1
                spans[(kind, name_of(r))].append((r["start_ns"], r["end_ns"]))
    for (kind, name), kind_spans in spans.items():
        rate = (window.moves if kind == "move" else window.collectives)[name]
        rate.busy_ns += union_ns(kind_spans)
        rate.wall_ns += wall
    for tier, series in live.items():
        peak = peak_in(series, wall_spans)
        if peak is not None:
            window.peak_live[tier] = max(window.peak_live.get(tier, 0), peak)


def _phase_order(phases: Iterable[str]) -> list[str]:
    return sorted(set(phases), key=lambda p: (PHASES.index(p) if p in PHASES else len(PHASES), p))


def summarize(traces: list[RankTrace], top: int = 5) -> Summary:
    """The summary of well-formed traces (run `drop_malformed` first on untrusted files)."""
    steps: dict[int, StepSummary] = {}
    by_phase: dict[str, Window] = {}
    total = Window(ALL, ALL)
    compute: dict[tuple[str, str], BlockStat] = {}
    stalls: dict[tuple[str, str], BlockStat] = {}
    pools: dict[str, tuple[int, int]] = {}
    for trace in traces:
        buckets, phase_spans, live = _buckets(trace), trace.phase_spans(), trace.live_series()
        step_spans = trace.steps()
        for step, (start, end, complete) in step_spans.items():
            summary = steps.setdefault(step, StepSummary(step, Window(step, ALL), {}))
            summary.total.complete &= complete
            keys = [k for k in set(buckets) | set(phase_spans) if k[0] == step]
            _add(summary.total, [buckets[k] for k in keys if k in buckets], [(start, end)], live)
            for key in keys:
                window = summary.phases.setdefault(key[1], Window(step, key[1]))
                window.complete = summary.total.complete
                _add(window, [buckets[key]] if key in buckets else [], phase_spans.get(key, []), live)
        for phase in {p for _, p in set(buckets) | set(phase_spans)}:
            keys = [k for k in set(buckets) | set(phase_spans) if k[1] == phase]
            spans = [s for k in keys for s in phase_spans.get(k, [])]
            window = by_phase.setdefault(phase, Window(ALL, phase))
            _add(window, [buckets[k] for k in keys if k in buckets], spans, live)
        _add(total, list(buckets.values()), [(s, e) for s, e, _ in step_spans.values()], live)
        for table, kind in ((compute, "compute"), (stalls, "stall")):
            for r in trace.of(kind):
                stat = table.setdefault((r["block"], r["phase"]), BlockStat(r["block"], r["phase"]))
                ns = r["end_ns"] - r["start_ns"]
                stat.total_ns, stat.count, stat.max_ns = stat.total_ns + ns, stat.count + 1, max(stat.max_ns, ns)
                if kind == "stall":
                    stat.waited_on[r["waited_on"]] = stat.waited_on.get(r["waited_on"], 0) + ns
        for r in trace.of("pool"):
            count, wait = pools.get(r["pool"], (0, 0))
            pools[r["pool"]] = (count + 1, wait + r["wait_ns"])
    for summary in steps.values():
        summary.phases = {p: summary.phases[p] for p in _phase_order(summary.phases)}
    meta = traces[0].meta if traces else {}
    return Summary(
        ranks=[t.rank for t in traces],
        world_size=int(meta.get("world_size", len(traces))),
        settings=meta.get("settings") or {},
        raw_disk=meta.get("raw_disk"),
        steps=[steps[s] for s in sorted(steps)],
        phases={p: by_phase[p] for p in _phase_order(by_phase)},
        total=total,
        slowest_compute=sorted(compute.values(), key=lambda b: -b.mean_ns)[:top],
        most_stalled=sorted(stalls.values(), key=lambda b: -b.total_ns)[:top],
        pools=pools,
        truncated=[t.path for t in traces if t.truncated],
    )
