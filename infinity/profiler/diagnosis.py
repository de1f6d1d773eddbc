"""The diagnosis: the verdict on the whole step, and the settings to change with the numbers that say so.

First the whole step (`verdict`): its bound, and its avoidable parts, largest saving first, each with
its cause and what removes it. Then the setting rules, each firing only past its threshold and
naming only a key that changes something in this run (`knob_effects`), with the value to set:

- forward/backward stalled > STALL_SHARE of the phase on disk reads while the read queue was not
  saturated (fewer than `aio.queue_depth` requests in flight) for >= QUEUE_IDLE_SHARE of the phase:
  reads start too late -> a larger `stage3_prefetch_bucket_size`. With the queue saturated instead and
  the disk near its probed speed (or of unknown speed), the disk is the limit -> keep more parameters
  in host memory (the key that sizes the read-ahead here). Far below its speed, the disk rule fires.
- forward/backward stalled > STALL_SHARE on host-to-device copies or on a gather's collective -> a
  larger prefetch bucket (not on gradient reductions: those wait for the slowest rank).
- forward/backward stalled > STALL_SHARE on the optimizer step running in it (its state reads and
  writes) while the disk was busy for less than OPTIMIZER_DISK_BUSY of the phase -> a larger optimizer
  window.
- the optimizer phase stalled > STALL_SHARE on the disk while the disk was busy for less than
  OPTIMIZER_DISK_BUSY of it: reads start too late -> a larger optimizer window.
- a buffer pool exhausted at least once per step (and POOL_MIN_COUNT times), or its waits >=
  POOL_WAIT_SHARE of step time -> more of that pool ("param": the read-ahead, "optimizer": the window,
  "grad" and "staging": the host budget where it is explicit).
- NVMe reads (writes) ran, while busy, below DISK_FRACTION of the probed disk -> more requests in
  flight (`aio.queue_depth`, then `aio.intra_op_parallelism`, then `aio.block_size`); not where the other
  direction ran beside them and both together kept the disk at DISK_FRACTION of its speed (a note).
A stall rule fires only where its stall is at least MIN_SAVING_SHARE of the step time: removing less would
change the step less than any avoidable part the verdict names.
The verdict says "no change needed" only when no setting is to change and the step is within
`verdict.MARGIN` of its bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infinity.profiler.analysis import Rate, Summary, Window, covered_below, depth_series
from infinity.profiler.breakdown import Breakdown, breakdown
from infinity.profiler.facts import RunFacts
from infinity.profiler.format import (
    COLLECTIVE,
    DISK_READ,
    DISK_WRITE,
    OPTIMIZER_STEP,
    TO_DEVICE,
    kind_of_key,
    wait_group,
)
from infinity.profiler.knob_effects import (
    Change,
    aio_change,
    host_budget_change,
    optimizer_window_change,
    prefetch_change,
    read_ahead_change,
)
from infinity.profiler.traces import RankTrace
from infinity.profiler.verdict import (
    DISK_FRACTION,
    MARGIN,
    MIN_DISK_BYTES,
    MIN_SAVING_SHARE,
    Bound,
    Finding,
    Remedy,
    bound,
    disk_use,
    find,
)

ALWAYS_GATHERED = ("<root>", "<persistent>")  # the engine's names for them: gathered for a whole pass
PARAM_READ_SHARE = 0.25  # below it, a phase's NVMe reads are mostly optimizer state: not the parameters' read-ahead
STALL_SHARE = 0.10
QUEUE_IDLE_SHARE = 0.5
OPTIMIZER_DISK_BUSY = 0.8
POOL_WAIT_SHARE = 0.01
POOL_MIN_COUNT = 3  # with fewer steps than this, still ask for this many exhaustions
HIGH_QUEUE_DEPTH = 32
HIGH_INTRA_OP = 8


@dataclass(frozen=True)
class Recommendation:
    """Set `setting` (a dotted config key) from `current` to `value` (and the keys of `also`); `evidence`
    has the numbers. `direction` is "raise" or "set"."""

    setting: str
    direction: str
    evidence: str
    current: Any = None
    value: Any = None
    also: tuple[tuple[str, Any], ...] = ()

    @property
    def action(self) -> str:
        def fmt(v: Any) -> str:
            return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)

        change = "" if self.value is None else f" {fmt(self.current)} -> {fmt(self.value)}"
        also = "".join(f" and {key} to {fmt(v)}" for key, v in self.also)
        return f"{self.direction} {self.setting}{change}{also}"

    def __str__(self) -> str:
        return f"{self.action}: {self.evidence}"


@dataclass
class Diagnosis:
    recommendations: list[Recommendation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # checks that could not run, and why
    verdict: str = ""
    findings: list[Finding] = field(default_factory=list)  # avoidable parts, largest saving first
    bound: Bound | None = None
    breakdown: Breakdown | None = None


class _Rules:
    """The setting rules over one run; `out` gets recommendations, `remedies` what they remove."""

    def __init__(self, summary: Summary, traces: list[RankTrace], facts: RunFacts, b: Breakdown) -> None:
        self.summary, self.traces, self.facts, self.b = summary, traces, facts, b
        self.out: list[Recommendation] = []
        self.remedies: dict[tuple[str, str], Remedy] = {}
        self.notes: list[str] = list(facts.notes)

    def recommend(self, change: Change | None, evidence: str, *parts: tuple[str, str]) -> None:
        if change is None:
            return
        direction = "set" if isinstance(change.value, str) else "raise"
        note = f" ({change.note})" if change.note else ""
        r = Recommendation(change.setting, direction, evidence + note, change.current, change.value, change.also)
        self.out.append(r)
        for part in parts:
            self.remedies.setdefault(part, Remedy(evidence, r.action, r.setting))

    def _minor(self, stall_ns: float) -> bool:
        """Whether a stall (summed over ranks and steps, as the summary's windows are) is below MIN_SAVING_SHARE
        of the step time."""
        total = self.summary.total.wall_ns
        return not total or stall_ns / total < MIN_SAVING_SHARE

    def _disk_fraction(self, reads: bool) -> tuple[Rate, float | None]:
        total = Rate()
        for pair, rate in self.summary.total.moves.items():
            src, dst = pair.split("->")
            if (src if reads else dst) == "nvme":
                total.bytes += rate.bytes
                total.busy_ns += rate.busy_ns
        raw = self.facts.raw(reads)
        if not raw or total.bytes < MIN_DISK_BYTES or not total.busy_ns:
            return total, None
        return total, total.gbps_busy / raw

    def _queue_idle(self, phase: str) -> tuple[float, bool]:
        """(share of `phase`'s wall time the NVMe read queue was not saturated, measured): from `queue`
        records, fewer than `aio.queue_depth` requests in flight; without them, estimated from moves: no
        NVMe read in flight at all (one move may fill the queue by itself)."""
        depth = int((self.facts.config.get("aio") or {}).get("queue_depth") or 1)
        below = total = 0
        measured = True
        for trace in self.traces:
            spans = [s for (_, p), ss in trace.phase_spans().items() if p == phase for s in ss]
            series, was_measured = depth_series(trace, "nvme-read")
            measured &= was_measured
            b, t = covered_below(series, spans, depth if was_measured else 1)
            below, total = below + b, total + t
        return (below / total if total else 0.0), measured

    def _param_read_share(self, phase: str) -> float:
        """Of the bytes `phase` read from NVMe, the share that are parameter shards (1.0 when it read none)."""
        read = params = 0
        for t in self.traces:
            for r in t.of("move"):
                if r["phase"] == phase and r["src"] == "nvme":
                    read += r["bytes"]
                    params += r["bytes"] if kind_of_key(r["key"]) == "param" else 0
        return params / read if read else 1.0

    def _block_read_stall_ns(self, phase: str) -> int:
        """Nanoseconds `phase` stalled on NVMe reads of blocks (what the prefetch bucket fetches ahead)."""
        return sum(
            r["end_ns"] - r["start_ns"]
            for t in self.traces
            for r in t.of("stall")
            if r["phase"] == phase and wait_group(r["waited_on"]) == DISK_READ and r["block"] not in ALWAYS_GATHERED
        )

    def stalls(self) -> None:
        f = self.facts
        prefetch = prefetch_change(f.config, f.world_size, f.block_elems)
        for phase in ("forward", "backward"):
            window = self.summary.phases.get(phase)
            if window is None or not window.wall_ns:
                continue
            groups = _groups(window)
            read_share = groups.get(DISK_READ, 0) / window.wall_ns
            if read_share > STALL_SHARE and not self._minor(groups.get(DISK_READ, 0)):
                idle, measured = self._queue_idle(phase)
                depth = (f.config.get("aio") or {}).get("queue_depth")
                how = (
                    f"held fewer than aio.queue_depth={depth} requests"
                    if measured
                    else "had no read in flight (estimated from moves; record queue depths to measure)"
                )
                if idle >= QUEUE_IDLE_SHARE:
                    evidence = (
                        f"{_pct(read_share)} of {phase} stalled on NVMe reads while the read queue {how} for "
                        f"{_pct(idle)} of {phase}: reads start too late"
                    )
                    if self._block_read_stall_ns(phase) / window.wall_ns > STALL_SHARE:
                        self.recommend(prefetch, evidence, (phase, DISK_READ))
                    else:  # the bucket fetches blocks ahead; these are read whole as each pass starts
                        self.notes.append(
                            f"{evidence}, on the parameters outside the blocks ({', '.join(ALWAYS_GATHERED)}), read "
                            "whole as each pass starts: no prefetch setting brings them sooner (parameters below "
                            "stage3_param_persistence_threshold are among them)"
                        )
                else:
                    rate, fraction = self._disk_fraction(reads=True)
                    if fraction is None or fraction >= DISK_FRACTION:
                        disk = "" if fraction is None else f", {fraction:.2f} of the probed disk's speed"
                        evidence = (
                            f"{_pct(read_share)} of {phase} stalled on NVMe reads with the read queue saturated for "
                            f"{_pct(1 - idle)} of {phase} and reads at {rate.gbps_busy:.2f} GB/s{disk}: the disk is "
                            "the limit"
                        )
                        param_share = self._param_read_share(phase)
                        if param_share >= PARAM_READ_SHARE:
                            change = read_ahead_change(f.config, f.largest_param_bytes)
                            why = f"{evidence}; keep more parameters in host memory"
                            self.recommend(change, why, (phase, DISK_READ))
                        else:  # a deferred step's state: the parameters' read-ahead would hold what is not read
                            self.notes.append(
                                f"{evidence}, and {_pct(1 - param_share)} of the bytes read are the optimizer's "
                                "state (a step run in this phase), not parameters: no parameter read-ahead setting "
                                "changes them"
                            )
            for group in (TO_DEVICE, COLLECTIVE):  # not REDUCTION: no prefetch brings the slowest rank sooner
                share = groups.get(group, 0) / window.wall_ns
                if share > STALL_SHARE and not self._minor(groups.get(group, 0)):
                    evidence = f"{_pct(share)} of {phase} stalled on {group}s: they are issued too late"
                    self.recommend(prefetch, evidence, (phase, group))
            self._step_in_phase(phase, window, groups.get(OPTIMIZER_STEP, 0))

    def _step_in_phase(self, phase: str, window: Window, stall_ns: int) -> None:
        """The optimizer step running in `phase` (deferred to the forward, or stepping shards as their
        gradients arrive) stalled it on its reads and writes while the disk had room: a larger window."""
        parts = self.b.mean.phase(phase)
        share = stall_ns / window.wall_ns
        if share <= STALL_SHARE or self._minor(stall_ns) or not parts.wall_ns:
            return
        busy = parts.disk_busy_ns / parts.wall_ns
        if busy >= OPTIMIZER_DISK_BUSY:
            return  # the disk is the limit: no window is faster than it
        evidence = (
            f"{_pct(share)} of {phase} stalled on the reads and writes of the optimizer step running in it while the "
            f"disk was busy for only {_pct(busy)} of {phase}: more shards in flight"
        )
        change = optimizer_window_change(self.facts.config, self.facts.largest_param_bytes)
        self.recommend(change, evidence, (phase, OPTIMIZER_STEP))

    def optimizer_stalls(self) -> None:
        window = self.summary.phases.get("optimizer")
        parts = self.b.mean.phase("optimizer")
        if window is None or not window.wall_ns or not parts.wall_ns:
            return
        busy = parts.disk_busy_ns / parts.wall_ns
        groups = _groups(window)
        for group in (DISK_READ, DISK_WRITE):
            share = groups.get(group, 0) / window.wall_ns
            if share <= STALL_SHARE or busy >= OPTIMIZER_DISK_BUSY or self._minor(groups.get(group, 0)):
                continue
            what = "reads" if group == DISK_READ else "writes"
            evidence = (
                f"{_pct(share)} of the optimizer step stalled on NVMe {what} while the disk was busy for only "
                f"{_pct(busy)} of it: more shards in flight"
            )
            change = optimizer_window_change(self.facts.config, self.facts.largest_param_bytes)
            self.recommend(change, evidence, ("optimizer", group))

    def pools(self) -> None:
        s, f = self.summary, self.facts
        steps = max(len(s.steps), 1)
        for pool, (count, wait_ns) in sorted(s.pools.items()):
            share = wait_ns / s.total.wall_ns if s.total.wall_ns else 0.0
            if count < max(POOL_MIN_COUNT, steps) and share < POOL_WAIT_SHARE:
                continue
            evidence = (
                f"buffer pool '{pool}' exhausted {count} times in {steps} step(s), waiting {wait_ns / 1e9:.3f} s "
                f"({_pct(share)} of step time)"
            )
            if pool == "param":
                change = read_ahead_change(f.config, f.largest_param_bytes)
            elif pool == "optimizer":
                change = optimizer_window_change(f.config, f.largest_param_bytes)
            elif pool in ("grad", "staging") and f.config.get("zero_optimization", {}).get("host_budget_bytes"):
                change = host_budget_change(f.config, 4 * f.largest_param_bytes, "the host budget is explicit")
            else:
                self.notes.append(f"{evidence}; no setting sizes a pool named '{pool}'")
                continue
            self.recommend(change, evidence, ("pool", pool))

    def disk(self) -> None:
        f = self.facts
        use = disk_use(self.b.mean, f)  # both directions together
        shared: list[str] = []  # slow directions the other one explains
        for reads in (True, False):
            rate, fraction = self._disk_fraction(reads)
            if rate.bytes and not f.raw_disk:
                self.notes.append(
                    "raw disk bandwidth unknown (meta raw_disk is null: the disk probe did not run): NVMe efficiency "
                    "not checked"
                )
                return
            if fraction is None or fraction >= DISK_FRACTION:
                continue
            what = "reads" if reads else "writes"
            evidence = (
                f"NVMe {what} ran at {rate.gbps_busy:.2f} GB/s while busy, {fraction:.2f} of the probed disk's "
                f"{f.raw(reads):.2f} GB/s"
            )
            if use is not None and use >= DISK_FRACTION:
                shared.append(evidence)
                continue
            change = aio_change(f.config, HIGH_QUEUE_DEPTH, HIGH_INTRA_OP)
            self.recommend(change, evidence, ("disk", "read" if reads else "write"))
        if shared:
            self.notes.append(
                f"{'; '.join(shared)}; but reads and writes ran at the same time, and together they kept the disk "
                f"at {use:.2f} of its probed speed while busy: the disk is the limit, not the requests in flight "
                "(no aio setting recommended)"
            )


def _groups(window: Window) -> dict[str, int]:
    groups: dict[str, int] = {}
    for wait, ns in window.stall_by_wait.items():
        groups[wait_group(wait)] = groups.get(wait_group(wait), 0) + ns
    return groups


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _merge(recommendations: list[Recommendation]) -> list[Recommendation]:
    merged: dict[str, Recommendation] = {}
    for r in recommendations:
        old = merged.get(r.setting)
        if old is not None:
            value = r.value if isinstance(r.value, str) else max(old.value, r.value)
            r = Recommendation(r.setting, r.direction, f"{old.evidence}; {r.evidence}", r.current, value, r.also)
        merged[r.setting] = r
    return list(merged.values())


def _verdict(d: Diagnosis, summary: Summary) -> str:
    b, limit = d.breakdown, d.bound
    step_s = b.mean.wall_ns / 1e9 if b else 0.0
    if d.findings:
        return d.findings[0].headline
    if d.recommendations:
        return f"{len(d.recommendations)} setting(s) to change"
    total = summary.total
    hit = "n/a" if total.hit_rate is None else _pct(total.hit_rate)
    stalls = f"stalls were {_pct(total.stall_share)} of step time, prefetch hit rate {hit}"
    if limit is None or limit.bound_s <= 0:
        return f"no setting to change, but the step's bound is unknown (see the notes): {stalls}"
    if step_s <= limit.bound_s * (1 + MARGIN):
        return f"no change needed: the {step_s:.3f} s step is within {_pct(MARGIN)} of its bound {limit}; {stalls}"
    return (
        f"no change found: the {step_s:.3f} s step is {_pct(step_s / limit.bound_s - 1)} above its bound {limit}, "
        "in parts no rule explains (see the step breakdown)"
    )


def diagnose(summary: Summary, traces: list[RankTrace]) -> Diagnosis:
    """The verdict and recommendations for the traced run; "no change needed" when it is near its bound."""
    facts = RunFacts.of(traces)
    b = breakdown(traces)
    rules = _Rules(summary, traces, facts, b)
    rules.stalls()
    rules.optimizer_stalls()
    rules.pools()
    rules.disk()
    result = Diagnosis(_merge(rules.out), rules.notes, breakdown=b)
    if b.rank_steps and not any(t.of("compute") for t in traces):
        result.notes.append(
            "the trace has no compute spans (no block was scheduled: the model is all root or persistent "
            "parameters), so the step's bound and its avoidable parts are unknown"
        )
    elif b.rank_steps:
        result.bound = bound(b, facts)
        if b.mean.wall_ns / 1e9 > result.bound.bound_s * (1 + MARGIN):  # within the margin nothing is avoidable
            result.findings = find(b, summary, facts, rules.remedies)
    result.verdict = _verdict(result, summary)
    return result
