"""The diagnosis: which settings to change, in which direction, with the numbers that say so.

Each rule reads the summary (and the traces, for queue depths during stalls) and fires only past its
threshold, so a well-tuned run gets no recommendation and the verdict "no change needed". Rules:

- forward/backward stalled > STALL_SHARE of the phase on NVMe reads while the read queue was not
  saturated (fewer than `aio.queue_depth` requests in flight) for >= QUEUE_IDLE_SHARE of the phase:
  the disk had room, reads were issued too late -> raise `stage3_prefetch_bucket_size`. With the queue
  saturated instead and the disk near its raw speed (or of unknown speed), the disk is the limit ->
  raise `offload_param.max_in_cpu` (keep more parameters in host memory); far below its raw speed,
  the disk rule below fires instead.
- forward/backward stalled > STALL_SHARE on host->device copies or on a collective -> raise
  `stage3_prefetch_bucket_size`.
- the optimizer phase stalled > STALL_SHARE on NVMe reads (writes) -> set
  `offload_optimizer.pipeline_read` (`pipeline_write`) true, or raise `offload_optimizer.buffer_count`.
- a buffer pool exhausted at least once per step (and POOL_MIN_COUNT times), or its waits >=
  POOL_WAIT_SHARE of step time ->
  raise that pool's `buffer_count` (`offload_param` for "param", `offload_optimizer` for "optimizer").
- NVMe reads (writes) ran, while busy, below DISK_FRACTION of meta.raw_disk -> raise `aio.queue_depth`
  (then `aio.intra_op_parallelism`, then `aio.block_size` once the former are already high).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infinity.profiler.analysis import Rate, Summary, Window, covered_below, depth_series
from infinity.profiler.format import COLLECTIVE_OPS
from infinity.profiler.traces import RankTrace

STALL_SHARE = 0.10
QUEUE_IDLE_SHARE = 0.5
POOL_WAIT_SHARE = 0.01
POOL_MIN_COUNT = 3  # with fewer steps than this, still ask for this many exhaustions
DISK_FRACTION = 0.6
MIN_DISK_BYTES = 8 << 20  # fewer bytes than this say nothing about a disk's speed
HIGH_QUEUE_DEPTH = 32
HIGH_INTRA_OP = 8


@dataclass(frozen=True)
class Recommendation:
    """Change `setting` in `direction` ("raise", "set true"); `evidence` has the numbers."""

    setting: str
    direction: str
    evidence: str
    current: Any = None

    def __str__(self) -> str:
        now = "" if self.current is None else f" (now {self.current})"
        return f"{self.direction} {self.setting}{now}: {self.evidence}"


@dataclass
class Diagnosis:
    recommendations: list[Recommendation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # checks that could not run, and why
    verdict: str = ""


def _setting(settings: dict, path: str) -> Any:
    value: Any = settings
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _nvme_rate(window: Window, reads: bool) -> Rate:
    total = Rate()
    for pair, rate in window.moves.items():
        src, dst = pair.split("->")
        if (src if reads else dst) == "nvme":
            total.bytes += rate.bytes
            total.busy_ns += rate.busy_ns
    return total


def _queue_idle(traces: list[RankTrace], phase: str, queue_depth: int) -> tuple[float, bool]:
    """(share of `phase`'s wall time the NVMe read queue was not saturated, measured).

    Measured from `queue` records: fewer than `queue_depth` requests in flight. Without them, estimated
    from moves: no NVMe read in flight at all (one move may fill the queue by itself).
    """
    below = total = 0
    measured = True
    for trace in traces:
        spans = [s for (_, p), ss in trace.phase_spans().items() if p == phase for s in ss]
        series, was_measured = depth_series(trace, "nvme-read")
        measured &= was_measured
        b, t = covered_below(series, spans, queue_depth if was_measured else 1)
        below, total = below + b, total + t
    return (below / total if total else 0.0), measured


def _disk_fraction(summary: Summary, reads: bool) -> tuple[Rate, float | None]:
    rate = _nvme_rate(summary.total, reads)
    raw = (summary.raw_disk or {}).get("read_gbps" if reads else "write_gbps")
    if not raw or rate.bytes < MIN_DISK_BYTES or not rate.busy_ns:
        return rate, None
    return rate, rate.gbps_busy / raw


def _stall_rules(summary: Summary, traces: list[RankTrace], out: list[Recommendation]) -> None:
    s = summary.settings
    queue_depth = _setting(s, "aio.queue_depth") or 1
    for phase in ("forward", "backward"):
        window = summary.phases.get(phase)
        if window is None or not window.wall_ns:
            continue
        reads = {w for w in window.stall_by_wait if w.startswith("nvme->")}
        read_share = sum(window.stall_by_wait[w] for w in reads) / window.wall_ns
        if read_share > STALL_SHARE:
            idle, measured = _queue_idle(traces, phase, queue_depth)
            how = (
                f"held fewer than aio.queue_depth={queue_depth} requests"
                if measured
                else "had no read in flight (estimated from moves; record queue depths to measure)"
            )
            if idle >= QUEUE_IDLE_SHARE:
                out.append(
                    Recommendation(
                        "stage3_prefetch_bucket_size",
                        "raise",
                        f"{_pct(read_share)} of {phase} stalled on NVMe reads while the read queue {how} for "
                        f"{_pct(idle)} of {phase}: reads start too late",
                        _setting(s, "stage3_prefetch_bucket_size"),
                    )
                )
            else:
                rate, fraction = _disk_fraction(summary, reads=True)
                if fraction is None or fraction >= DISK_FRACTION:
                    disk = "" if fraction is None else f", {fraction:.2f} of raw disk bandwidth"
                    out.append(
                        Recommendation(
                            "offload_param.max_in_cpu",
                            "raise",
                            f"{_pct(read_share)} of {phase} stalled on NVMe reads with the read queue saturated for "
                            f"{_pct(1 - idle)} of {phase} and reads at {rate.gbps_busy:.2f} GB/s{disk}: the disk is "
                            "the limit; keep more parameters in host memory",
                            _setting(s, "offload_param.max_in_cpu"),
                        )
                    )
        for wait, ns in sorted(window.stall_by_wait.items()):
            share = ns / window.wall_ns
            if wait in reads or share <= STALL_SHARE or wait == "pool":
                continue
            what = f"{wait} collectives" if wait in COLLECTIVE_OPS else f"{wait} copies"
            out.append(
                Recommendation(
                    "stage3_prefetch_bucket_size",
                    "raise",
                    f"{_pct(share)} of {phase} stalled on {what}: they are issued too late",
                    _setting(s, "stage3_prefetch_bucket_size"),
                )
            )
    window = summary.phases.get("optimizer")
    if window is not None and window.wall_ns:
        for reads, flag in ((True, "pipeline_read"), (False, "pipeline_write")):
            ns = sum(v for w, v in window.stall_by_wait.items() if w.split("->")[0 if reads else -1] == "nvme")
            if ns / window.wall_ns <= STALL_SHARE:
                continue
            what = "reads" if reads else "writes"
            evidence = f"{_pct(ns / window.wall_ns)} of the optimizer step stalled on NVMe {what}"
            if not _setting(s, f"offload_optimizer.{flag}"):
                out.append(Recommendation(f"offload_optimizer.{flag}", "set true", evidence + ": overlap them", False))
            else:
                out.append(
                    Recommendation(
                        "offload_optimizer.buffer_count",
                        "raise",
                        evidence + " with the pipeline on",
                        _setting(s, "offload_optimizer.buffer_count"),
                    )
                )


def _pool_rules(summary: Summary, out: list[Recommendation]) -> None:
    steps = max(len(summary.steps), 1)
    for pool, (count, wait_ns) in sorted(summary.pools.items()):
        share = wait_ns / summary.total.wall_ns if summary.total.wall_ns else 0.0
        if count < max(POOL_MIN_COUNT, steps) and share < POOL_WAIT_SHARE:
            continue
        section = {"param": "offload_param", "optimizer": "offload_optimizer"}.get(pool, pool)
        setting = f"{section}.buffer_count"
        out.append(
            Recommendation(
                setting,
                "raise",
                f"buffer pool '{pool}' exhausted {count} times in {steps} step(s), waiting {wait_ns / 1e9:.3f} s "
                f"({_pct(share)} of step time)",
                _setting(summary.settings, setting),
            )
        )


def _disk_rules(summary: Summary, out: list[Recommendation], notes: list[str]) -> None:
    s = summary.settings
    for reads in (True, False):
        rate, fraction = _disk_fraction(summary, reads)
        if rate.bytes and not summary.raw_disk:
            notes.append("raw disk bandwidth unknown (meta raw_disk is null): NVMe efficiency not checked")
            return
        if fraction is None or fraction >= DISK_FRACTION:
            continue
        raw = summary.raw_disk["read_gbps" if reads else "write_gbps"]
        depth, intra = _setting(s, "aio.queue_depth") or 1, _setting(s, "aio.intra_op_parallelism") or 1
        setting = (
            "aio.queue_depth"
            if depth < HIGH_QUEUE_DEPTH
            else "aio.intra_op_parallelism"
            if intra < HIGH_INTRA_OP
            else "aio.block_size"
        )
        out.append(
            Recommendation(
                setting,
                "raise",
                f"NVMe {'reads' if reads else 'writes'} ran at {rate.gbps_busy:.2f} GB/s while busy, {fraction:.2f} of "
                f"the raw disk's {raw:.2f} GB/s",
                _setting(s, setting),
            )
        )


def _merge(recommendations: list[Recommendation]) -> list[Recommendation]:
    merged: dict[tuple[str, str], Recommendation] = {}
    for r in recommendations:
        if (r.setting, r.direction) in merged:
            old = merged[(r.setting, r.direction)]
            r = Recommendation(r.setting, r.direction, f"{old.evidence}; {r.evidence}", r.current)
        merged[(r.setting, r.direction)] = r
    return list(merged.values())


def diagnose(summary: Summary, traces: list[RankTrace]) -> Diagnosis:
    """Recommendations for the traced run; none (and a "no change needed" verdict) when it is well tuned."""
    out: list[Recommendation] = []
    notes: list[str] = []
    _stall_rules(summary, traces, out)
    _pool_rules(summary, out)
    _disk_rules(summary, out, notes)
    result = Diagnosis(_merge(out), notes)
    total = summary.total
    hit = "n/a" if total.hit_rate is None else _pct(total.hit_rate)
    exhausted = sum(count for count, _ in summary.pools.values())
    result.verdict = (
        f"{len(result.recommendations)} setting(s) to change"
        if result.recommendations
        else f"no change needed: stalls were {_pct(total.stall_share)} of step time, prefetch hit rate {hit}, "
        f"buffer pools exhausted {exhausted} time(s)"
    )
    return result
