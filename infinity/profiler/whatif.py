"""What-if: the step time one change would give, predicted from one run's breakdown, and the check of a
prediction against a run with the change made.

Every prediction keeps the run's bytes and the rates its disk reached (busy time per byte, from the
trace), and moves or removes time as the change would:
- `optimizer_overlap`: the optimizer steps each shard during backward, as infinity does without
  clipping or fp16 (StreamedAdam.step_as_grads_arrive). Its disk time moves into backward, less the
  gradient round trip (the gradients' NVMe writes in backward and reads in the optimizer vanish); its
  arithmetic joins backward's main thread (on a CPU-only run) or overlaps it (CUDA); backward becomes
  the longer of its compute path and its disk time; what stays after backward is the last
  `window // 2` shards' share of the old optimizer phase.
- `stalls_removed`: a phase's stalls on one wait group vanish, but a phase never gets shorter than
  its disk busy time (the bytes still have to move).
- `disk_at_raw`: the time the run was exposed to the disk (disk stalls, serial I/O, the optimizer
  phase when it streams) shrinks by the ratio of the reached to the probed rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from infinity.profiler.breakdown import Breakdown, PhaseParts
from infinity.profiler.format import DISK_READ, DISK_WRITE, OPTIMIZER_STEP
from infinity.profiler.traces import RankTrace


@dataclass(frozen=True)
class Prediction:
    """The mean step per rank now and with `change`; `how` is the arithmetic in words."""

    change: str
    step_s: float
    predicted_step_s: float
    how: str

    @property
    def saving_s(self) -> float:
        return self.step_s - self.predicted_step_s

    def __str__(self) -> str:
        share = self.saving_s / self.step_s if self.step_s else 0.0
        return (
            f"{self.change}: step {self.step_s:.3f} s -> predicted {self.predicted_step_s:.3f} s "
            f"(saving {self.saving_s:.3f} s, {share:.0%}); {self.how}"
        )


def _s(ns: float) -> float:
    return ns / 1e9


def optimizer_overlap(b: Breakdown, window: int, cuda: bool) -> Prediction | None:
    """The step with the optimizer stepping during backward (see the module doc); None without an optimizer phase."""
    m = b.mean
    opt, bwd = m.phase("optimizer"), m.phase("backward")
    if not opt.wall_ns or not b.optimizer_shards:
        return None
    opt_bytes = opt.nvme("read") + opt.nvme("write")
    kept = opt_bytes - opt.nvme("read", "grad")
    moved_disk_ns = opt.disk_busy_ns * (kept / opt_bytes) if opt_bytes else 0.0
    bwd_bytes = bwd.nvme("read") + bwd.nvme("write")
    grad_writes = bwd.nvme("write", "grad")
    bwd_disk_ns = bwd.disk_busy_ns * (1 - grad_writes / bwd_bytes) if bwd_bytes else 0.0
    arithmetic_ns = opt.compute_ns if opt.compute_ns else opt.other_ns
    compute_path_ns = max(bwd.wall_ns, arithmetic_ns) if cuda else bwd.wall_ns + arithmetic_ns
    new_bwd_ns = max(compute_path_ns, bwd_disk_ns + moved_disk_ns)
    tail_shards = min(max(1, window // 2), b.optimizer_shards)
    tail_ns = opt.wall_ns * tail_shards / b.optimizer_shards
    predicted_ns = m.wall_ns - bwd.wall_ns - opt.wall_ns + new_bwd_ns + tail_ns
    join = "overlapping it (CUDA)" if cuda else "on its thread"
    how = (
        f"backward = max(compute path {_s(compute_path_ns):.3f} s [backward {_s(bwd.wall_ns):.3f} s with the "
        f"optimizer's arithmetic {_s(arithmetic_ns):.3f} s {join}], disk {_s(bwd_disk_ns):.3f} s + the optimizer's "
        f"{_s(moved_disk_ns):.3f} s without the gradient round trip) = {_s(new_bwd_ns):.3f} s, then "
        f"{tail_shards:g} of {b.optimizer_shards:g} shards after it: {_s(tail_ns):.3f} s"
    )
    return Prediction("the optimizer step overlapped with backward", _s(m.wall_ns), _s(predicted_ns), how)


def _phase_floor_ns(parts: PhaseParts, removed_ns: float, group: str) -> float:
    """The phase's new wall time with `removed_ns` of stalls on `group` gone."""
    floor = parts.disk_busy_ns if group in (DISK_READ, DISK_WRITE, OPTIMIZER_STEP) else 0.0
    return max(parts.wall_ns - removed_ns, floor, parts.wall_ns - parts.stall_total_ns)


def stalls_removed(b: Breakdown, phase: str, group: str, change: str) -> Prediction:
    """The step without `phase`'s stalls on `group` ("disk read", "collective", ...), disk time kept."""
    m = b.mean
    parts = m.phase(phase)
    removed = parts.stall_ns.get(group, 0.0)
    new_ns = _phase_floor_ns(parts, removed, group)
    how = (
        f"{phase} {_s(parts.wall_ns):.3f} s less {_s(removed):.3f} s of {group} stalls, "
        f"no shorter than its disk busy time {_s(parts.disk_busy_ns):.3f} s: {_s(new_ns):.3f} s"
    )
    return Prediction(change, _s(m.wall_ns), _s(m.wall_ns - parts.wall_ns + new_ns), how)


def disk_exposed_ns(parts: PhaseParts, streams: bool) -> float:
    """Time of a phase the training thread spent on the disk: its disk stalls and its serial I/O, or
    (`streams`: the optimizer phase streaming its state) its whole disk busy time."""
    if streams:
        return parts.disk_busy_ns
    disk_stalls = sum(parts.stall_ns.get(group, 0.0) for group in (DISK_READ, DISK_WRITE, OPTIMIZER_STEP))
    return disk_stalls + parts.serial_io_ns


def disk_at_raw(b: Breakdown, reached_fraction: float, change: str) -> Prediction:
    """The step with the disk at its probed speed: exposed disk time x `reached_fraction` (reached / raw)."""
    m = b.mean
    exposed = sum(disk_exposed_ns(p, name == "optimizer") for name, p in m.phases.items())
    saving = exposed * (1 - min(1.0, reached_fraction))
    how = (
        f"{_s(exposed):.3f} s exposed to the disk per step at {reached_fraction:.2f} of its probed speed "
        f"-> {_s(exposed * min(1.0, reached_fraction)):.3f} s"
    )
    return Prediction(change, _s(m.wall_ns), _s(m.wall_ns - saving), how)


@dataclass(frozen=True)
class Check:
    """A prediction against the run that made its change (mean step per rank of its traces)."""

    prediction: Prediction
    measured_step_s: float

    @property
    def measured_saving_s(self) -> float:
        return self.prediction.step_s - self.measured_step_s

    @property
    def saving_error(self) -> float | None:
        """(predicted saving - measured saving) / measured saving; None when nothing was measured saved."""
        measured = self.measured_saving_s
        return (self.prediction.saving_s - measured) / measured if measured > 0 else None

    def __str__(self) -> str:
        p = self.prediction
        error = self.saving_error
        off = "n/a (the measured run saved nothing)" if error is None else f"{error:+.0%}"
        return (
            f"what-if check, {p.change}: predicted step {p.predicted_step_s:.3f} s (saving {p.saving_s:.3f} s), "
            f"measured {self.measured_step_s:.3f} s (saving {self.measured_saving_s:.3f} s) from "
            f"{p.step_s:.3f} s; predicted saving off by {off}"
        )


def check(prediction: Prediction, measured: list[RankTrace]) -> Check:
    """Compare `prediction` with the mean step of `measured` (traces of a run with the change made)."""
    from infinity.profiler.breakdown import breakdown

    return Check(prediction, _s(breakdown(measured).mean.wall_ns))
