"""Where each step's time went: per phase, compute, stalls by what they waited on, serial I/O, other.

Per rank, each phase's wall time (the union of its spans within the step) is split into disjoint parts:
- stall: a `stall` span covers it, by `format.wait_group` ("disk read", "collective", ...);
- compute: a `compute` span covers it and no stall does;
- serial I/O: neither, but a move is in flight: I/O that no recorded compute overlaps (the optimizer
  streaming its state after backward; a wait the engine did not record as a stall);
- other: none of these (Python, host work, the optimizer's arithmetic when it records no compute).
Each phase also carries its NVMe bytes, split by direction and by MOVE_KINDS (a move's bytes are
shared among the phases in proportion to its span's overlap with each), and the disk's busy time (the
union of NVMe moves). `Breakdown.mean` is the mean step per rank over the complete steps of all ranks.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from infinity.profiler import intervals as iv
from infinity.profiler.attribution import block_name
from infinity.profiler.format import PHASES, kind_of_key, tier_pair, wait_group
from infinity.profiler.traces import RankTrace, Record


@dataclass
class PhaseParts:
    """One phase's parts in nanoseconds and its NVMe traffic; sums over rank-steps until averaged."""

    phase: str
    wall_ns: float = 0.0
    compute_ns: float = 0.0
    stall_ns: dict[str, float] = field(default_factory=dict)  # wait group -> ns
    serial_io_ns: float = 0.0
    serial_io_by_pair: dict[str, float] = field(default_factory=dict)  # tier pair -> ns in flight in serial I/O
    nvme_bytes: dict[tuple[str, str], float] = field(default_factory=dict)  # (kind, "read"/"write") -> bytes
    read_busy_ns: float = 0.0  # union of NVMe reads
    write_busy_ns: float = 0.0
    disk_busy_ns: float = 0.0  # union of both
    optimizer_blocks: set[str] = field(default_factory=set)  # blocks whose optimizer state moved or stepped

    @property
    def stall_total_ns(self) -> float:
        return sum(self.stall_ns.values())

    @property
    def other_ns(self) -> float:
        return max(0.0, self.wall_ns - self.compute_ns - self.stall_total_ns - self.serial_io_ns)

    def nvme(self, direction: str, kind: str | None = None) -> float:
        """NVMe bytes read ("read") or written ("write"), of one MOVE_KINDS value or all."""
        return sum(b for (k, d), b in self.nvme_bytes.items() if d == direction and kind in (None, k))

    def add(self, other: PhaseParts) -> None:
        self.wall_ns += other.wall_ns
        self.compute_ns += other.compute_ns
        self.serial_io_ns += other.serial_io_ns
        self.read_busy_ns += other.read_busy_ns
        self.write_busy_ns += other.write_busy_ns
        self.disk_busy_ns += other.disk_busy_ns
        for mine, theirs in (
            (self.stall_ns, other.stall_ns),
            (self.serial_io_by_pair, other.serial_io_by_pair),
            (self.nvme_bytes, other.nvme_bytes),
        ):
            for key, value in theirs.items():
                mine[key] = mine.get(key, 0.0) + value
        self.optimizer_blocks |= other.optimizer_blocks

    def scaled(self, factor: float) -> PhaseParts:
        out = PhaseParts(self.phase)
        out.add(self)
        for name in ("wall_ns", "compute_ns", "serial_io_ns", "read_busy_ns", "write_busy_ns", "disk_busy_ns"):
            setattr(out, name, getattr(out, name) * factor)
        for table in (out.stall_ns, out.serial_io_by_pair, out.nvme_bytes):
            for key in table:
                table[key] *= factor
        return out


@dataclass
class StepParts:
    step: int
    wall_ns: float = 0.0
    phases: dict[str, PhaseParts] = field(default_factory=dict)
    complete: bool = True

    def phase(self, name: str) -> PhaseParts:
        """The phase's parts (empty ones for a phase the step did not have)."""
        return self.phases.get(name) or PhaseParts(name)

    def add(self, other: StepParts) -> None:
        self.wall_ns += other.wall_ns
        self.complete &= other.complete
        for name, parts in other.phases.items():
            self.phases.setdefault(name, PhaseParts(name)).add(parts)


@dataclass
class Breakdown:
    """Per step (summed over ranks) and the mean step of one rank; `optimizer_shards`: shards stepped per step."""

    ranks: int
    steps: list[StepParts]
    mean: StepParts
    rank_steps: int  # complete (rank, step) pairs the mean is over
    optimizer_shards: float = 0.0


def _moves_near(by_step: dict[int, list[Record]], step: int) -> list[Record]:
    # a move is tagged with the step in force when it completed: one crossing into the next step has its tag
    return by_step.get(step, []) + by_step.get(step + 1, [])


def _phase_parts(
    phase: str, spans: list[iv.Span], compute: list[iv.Span], stalls: dict[str, list[iv.Span]], moves: list[Record]
) -> PhaseParts:
    window = iv.merge(spans)
    parts = PhaseParts(phase, wall_ns=float(iv.length(window)))
    stalled: list[iv.Span] = []
    for group, group_spans in stalls.items():
        inside = iv.intersect(group_spans, window)
        if inside:
            parts.stall_ns[group] = float(iv.length(inside))
            stalled += inside
    stalled = iv.merge(stalled)
    busy = iv.merge(iv.intersect(compute, window) + stalled)
    parts.compute_ns = float(iv.length(iv.subtract(iv.intersect(compute, window), stalled)))
    in_window = [m for m in moves if m["end_ns"] > window[0][0] and m["start_ns"] < window[-1][1]] if window else []
    io = iv.intersect(iv.merge((m["start_ns"], m["end_ns"]) for m in in_window), window)
    serial = iv.subtract(io, busy)
    parts.serial_io_ns = float(iv.length(serial))
    by_pair: dict[str, list[iv.Span]] = defaultdict(list)
    reads, writes = [], []
    for m in in_window:
        pair = tier_pair(m["src"], m["dst"])
        span = (m["start_ns"], m["end_ns"])
        by_pair[pair].append(span)
        if "nvme" not in (m["src"], m["dst"]):
            continue
        direction = "read" if m["src"] == "nvme" else "write"
        (reads if direction == "read" else writes).append(span)
        duration = span[1] - span[0]
        inside = iv.overlap_ns(span if duration else (span[1] - 1, span[1]), window)
        share = inside / duration if duration else float(inside)
        if share:
            kind = kind_of_key(m["key"])
            parts.nvme_bytes[(kind, direction)] = parts.nvme_bytes.get((kind, direction), 0.0) + m["bytes"] * share
            if kind == "optimizer":
                parts.optimizer_blocks.add(block_name(m["block"]))
    if serial:
        for pair, pair_spans in by_pair.items():
            ns = iv.length(iv.intersect(iv.merge(pair_spans), serial))
            if ns:
                parts.serial_io_by_pair[pair] = float(ns)
    reads_in, writes_in = iv.intersect(iv.merge(reads), window), iv.intersect(iv.merge(writes), window)
    parts.read_busy_ns, parts.write_busy_ns = float(iv.length(reads_in)), float(iv.length(writes_in))
    parts.disk_busy_ns = float(iv.length(iv.merge(reads_in + writes_in)))
    return parts


def serial_io_spans(trace: RankTrace) -> list[iv.Span]:
    """The times of `trace`'s phases when a move was in flight and the thread neither computed nor stalled."""
    phases = iv.merge(s for spans in trace.phase_spans().values() for s in spans)
    busy = iv.merge([(r["start_ns"], r["end_ns"]) for kind in ("compute", "stall") for r in trace.of(kind)])
    io = iv.merge((r["start_ns"], r["end_ns"]) for r in trace.of("move"))
    return iv.subtract(iv.intersect(io, phases), busy)


def rank_steps(trace: RankTrace) -> list[StepParts]:
    """One rank's steps, each split into its phases' parts."""
    compute = iv.merge((r["start_ns"], r["end_ns"]) for r in trace.of("compute"))
    stall_spans: dict[str, list[iv.Span]] = defaultdict(list)
    for r in trace.of("stall"):
        stall_spans[wait_group(r["waited_on"])].append((r["start_ns"], r["end_ns"]))
    stalls = {group: iv.merge(spans) for group, spans in stall_spans.items()}
    moves_by_step: dict[int, list[Record]] = defaultdict(list)
    for m in trace.of("move"):
        moves_by_step[m["step"]].append(m)
    stepped: dict[int, set[str]] = defaultdict(set)
    for r in trace.of("compute"):
        if r["phase"] == "optimizer":
            stepped[r["step"]].add(block_name(r["block"]))
    phase_spans = trace.phase_spans()
    out = []
    for step, (start, end, complete) in trace.steps().items():
        parts = StepParts(step, float(end - start), complete=complete)
        moves = _moves_near(moves_by_step, step)
        names = sorted({p for s, p in phase_spans if s == step}, key=lambda p: (PHASES + (p,)).index(p))
        for name in names:
            spans = [(max(s, start), min(e, end)) for s, e in phase_spans[(step, name)]]
            parts.phases[name] = _phase_parts(name, spans, compute, stalls, moves)
            if name == "optimizer":  # a shard stepped in memory (the host optimizer) moves nothing
                parts.phases[name].optimizer_blocks |= stepped.get(step, set())
        out.append(parts)
    return out


def breakdown(traces: list[RankTrace]) -> Breakdown:
    """Every rank's steps split into parts, summed per step over ranks, and the mean step per rank."""
    per_step: dict[int, StepParts] = {}
    total = StepParts(-1)
    counted = 0
    everything = StepParts(-1)
    for trace in traces:
        for parts in rank_steps(trace):
            per_step.setdefault(parts.step, StepParts(parts.step)).add(parts)
            everything.add(parts)
            if parts.complete:
                total.add(parts)
                counted += 1
    if not counted:  # only steps cut by a crash: average those
        total, counted = everything, sum(len(t.steps()) for t in traces)
    mean = StepParts(-1, total.wall_ns / counted if counted else 0.0, complete=total.complete)
    mean.phases = {name: parts.scaled(1 / counted) for name, parts in total.phases.items()} if counted else {}
    shards = len(mean.phase("optimizer").optimizer_blocks | mean.phase("backward").optimizer_blocks)
    return Breakdown(len(traces), [per_step[s] for s in sorted(per_step)], mean, counted, float(shards))
