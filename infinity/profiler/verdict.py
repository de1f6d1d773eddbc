"""The verdict on the whole step: its bound, and its avoidable parts, largest saving first.

Bound (per rank): the longer of the recorded compute (forward and backward, plus the optimizer's
arithmetic on a CPU-only run; the longer of the two with CUDA) and the disk's time for the run's
NVMe bytes at the probed speed (reads, then writes: reads / raw read + writes / raw write; without a
probe, the disk's busy time in the run). A step within MARGIN of its bound needs no change.

Avoidable parts, each with its cause from the run's config and trace, the saving a what-if predicts
(`whatif`) and what removes it (a setting that changes something, see `knob_effects`, or the feature
that would):
- the optimizer phase after backward, when the optimizer does not step during backward (why: the
  config's `gradient_clipping`, fp16 loss scaling, or the host optimizer);
- stalls of forward / backward (and of an optimizer phase already overlapped) per wait group;
- serial I/O in forward / backward: I/O nothing overlaps while the thread records no wait;
- the disk below its probed speed; buffer pool waits.
Parts saving less than MIN_SAVING_SHARE of the step are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from infinity.profiler.analysis import Summary
from infinity.profiler.breakdown import Breakdown, PhaseParts, StepParts
from infinity.profiler.facts import RunFacts
from infinity.profiler.format import DISK_READ, DISK_WRITE, OPTIMIZER_STEP, POOL, REDUCTION
from infinity.profiler.whatif import Prediction, disk_at_raw, optimizer_overlap, stalls_removed

MARGIN = 0.10
MIN_SAVING_SHARE = 0.03
DISK_FRACTION = 0.6
MIN_DISK_BYTES = 8 << 20
OVERLAP_FEATURE = "the optimizer step overlapped with the next forward"


@dataclass(frozen=True)
class Bound:
    compute_s: float
    disk_s: float
    probed: bool  # disk time at the probed speed (else the run's own busy time)

    @property
    def bound_s(self) -> float:
        return max(self.compute_s, self.disk_s)

    @property
    def kind(self) -> str:
        return "compute" if self.compute_s >= self.disk_s else "disk"

    def __str__(self) -> str:
        disk = "at the probed speed" if self.probed else "busy in this run (no disk probe)"
        return f"{self.bound_s:.3f} s ({self.kind}: compute {self.compute_s:.3f} s, disk {self.disk_s:.3f} s {disk})"


@dataclass(frozen=True)
class Remedy:
    """What a setting rule found about one part: why it happens, and the change that removes it."""

    cause: str
    action: str  # "raise aio.queue_depth 8 -> 16", or a feature in words
    setting: str | None = None


@dataclass(frozen=True)
class Finding:
    """One avoidable part of the mean step: `headline` is the line a person reads first."""

    part: str
    time_s: float
    cause: str
    remedy: str
    prediction: Prediction
    setting: str | None = None  # the config key `remedy` names, if any

    @property
    def headline(self) -> str:
        p = self.prediction
        share = self.time_s / p.step_s if p.step_s else 0.0
        saving = p.saving_s / p.step_s if p.step_s else 0.0
        return (
            f"{self.part}: {self.time_s:.3f} s of the {p.step_s:.3f} s step ({share:.0%}), {self.cause}; "
            f"expected saving {p.saving_s:.3f} s per step ({saving:.0%})"
        )


def bound(b: Breakdown, facts: RunFacts) -> Bound:
    m = b.mean
    model_ns = sum(p.compute_ns for name, p in m.phases.items() if name != "optimizer")
    optimizer_ns = m.phase("optimizer").compute_ns
    # the optimizer's arithmetic runs on the CPU: beside the GPU's forward and backward, but on a CPU-only
    # machine on the same cores as them
    compute_ns = max(model_ns, optimizer_ns) if facts.cuda else model_ns + optimizer_ns
    reads = sum(p.nvme("read") for p in m.phases.values())
    writes = sum(p.nvme("write") for p in m.phases.values())
    raw_r, raw_w = facts.raw(True), facts.raw(False)
    if raw_r and raw_w:
        return Bound(compute_ns / 1e9, reads / raw_r / 1e9 + writes / raw_w / 1e9, True)
    return Bound(compute_ns / 1e9, sum(p.disk_busy_ns for p in m.phases.values()) / 1e9, False)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def _rate(parts: PhaseParts, reads: bool, facts: RunFacts) -> str:
    nbytes = parts.nvme("read" if reads else "write")
    busy = parts.read_busy_ns if reads else parts.write_busy_ns
    if not nbytes or not busy:
        return ""
    gbps, raw = nbytes / busy, facts.raw(reads)
    against = f" ({gbps / raw:.2f} of the probed {raw:.2f} GB/s)" if raw else " (disk not probed)"
    return f"{_gb(nbytes)} {'read' if reads else 'written'} at {gbps:.2f} GB/s{against}"


def _optimizer_cause(facts: RunFacts) -> tuple[str, str]:
    """(why the optimizer runs after backward, what would remove it)."""
    if facts.optimizer_device == "cpu":
        return (
            "the host optimizer (offload_optimizer.device cpu) steps every shard after backward",
            "a host optimizer step overlapped with backward (a feature infinity does not have yet)",
        )
    if facts.gradient_clipping > 0:
        cause = (
            f"because gradient_clipping is {facts.gradient_clipping}: the norm of all gradients must be known "
            "before any shard steps, so the optimizer cannot step during backward"
        )
        zero = facts.config.get("zero_optimization") or {}
        param_device = (zero.get("offload_param") or {}).get("device", "none")
        # parameters are gathered (not resident) at stage 3 unless one rank computes where they live; one rank
        # computing from host memory (no device budget set apart) steps its resident parameters just before
        # their block's next forward
        apart = param_device == "nvme" or (param_device == "cpu" and facts.cuda)
        gathered = zero.get("stage", 3) == 3 and (apart or facts.world_size > 1)
        host_compute = not facts.cuda and zero.get("device_budget_bytes") is None
        if gathered or (facts.world_size == 1 and host_compute):
            return cause, (
                f"{OVERLAP_FEATURE}, which infinity now does for this config (each shard steps just before the next "
                "forward uses it): the trace is from an older version; or gradient_clipping 0, which changes "
                "the training"
            )
        return cause, (
            f"{OVERLAP_FEATURE}, which infinity does where parameters are gathered: offload_param.device nvme "
            "at stage 3 (each shard then steps just before the next forward gathers it, at the cost of reading "
            "the parameters from NVMe); or gradient_clipping 0, which changes the training"
        )
    if facts.fp16:
        return (
            "because fp16 loss scaling must see every gradient (an overflow skips the step) before any shard steps",
            "bf16 instead of fp16 (no loss scale), or the optimizer step overlapped with backward under loss scaling",
        )
    if not facts.has_config:
        return "for a reason the trace cannot tell (it has no config: written by an older infinity)", "unknown"
    return (
        "although nothing in the config keeps it from stepping during backward (a client optimizer passed to "
        "initialize?)",
        "let infinity build the optimizer from the config's 'optimizer' section",
    )


def _optimizer_finding(b: Breakdown, facts: RunFacts) -> Finding | None:
    opt, bwd = b.mean.phase("optimizer"), b.mean.phase("backward")
    if not opt.wall_ns or bwd.nvme("read", "optimizer") or bwd.nvme("write", "optimizer"):
        return None  # no optimizer phase, or it steps during backward already and this is its tail
    prediction = optimizer_overlap(b, facts.optimizer_window, facts.cuda)
    if prediction is None:
        return None
    cause, remedy = _optimizer_cause(facts)
    rates = [r for r in (_rate(opt, True, facts), _rate(opt, False, facts)) if r]
    streaming = f"streaming {' and '.join(rates)} from NVMe, " if rates else ""
    return Finding("optimizer phase after backward", opt.wall_ns / 1e9, streaming + cause, remedy, prediction)


NO_SETTING = Remedy("", "no setting found")
_WAITED_FOR = {
    DISK_READ: "disk reads",
    DISK_WRITE: "disk writes",
    OPTIMIZER_STEP: "the reads and writes of the optimizer step running in it",
    REDUCTION: "the gradient reductions (the slowest rank's gradients)",
}


def _disk_remedy(group: str, remedies: dict[tuple[str, str], Remedy]) -> Remedy | None:
    """The disk rule's remedy for stalls on `group`, where they wait on the disk."""
    if group == DISK_READ:
        return remedies.get(("disk", "read"))
    if group == DISK_WRITE:
        return remedies.get(("disk", "write"))
    if group == OPTIMIZER_STEP:
        return remedies.get(("disk", "read")) or remedies.get(("disk", "write"))
    return None


def find(b: Breakdown, summary: Summary, facts: RunFacts, remedies: dict[tuple[str, str], Remedy]) -> list[Finding]:
    """The avoidable parts of the mean step, largest saving first.

    `remedies`: (phase, wait group), ("disk", "read"/"write") or ("pool", name) -> the `Remedy` a setting
    rule found for that part, naming a key that changes something.
    """
    m = b.mean
    step_s = m.wall_ns / 1e9
    out: list[Finding] = []
    optimizer = _optimizer_finding(b, facts)
    if optimizer is not None:
        out.append(optimizer)
    for name, parts in m.phases.items():
        if name == "optimizer" and optimizer is not None:
            continue  # its stalls are part of the phase the overlap removes
        for group, ns in sorted(parts.stall_ns.items(), key=lambda kv: -kv[1]):
            if group == POOL:
                continue
            r = remedies.get((name, group)) or _disk_remedy(group, remedies) or NO_SETTING
            what = _WAITED_FOR.get(group, group + "s")
            change = r.action if r.setting else f"no {group} stalls in {name}"
            out.append(
                Finding(
                    f"{group} stalls in {name}",
                    ns / 1e9,
                    f"the training thread waited on {what}" + (f" ({r.cause})" if r.cause else ""),
                    r.action,
                    stalls_removed(b, name, group, change),
                    r.setting,
                )
            )
        if name != "optimizer" and parts.serial_io_ns:
            in_flight = sorted(parts.serial_io_by_pair.items(), key=lambda kv: -kv[1])
            pairs = ", ".join(f"{pair} {ns / 1e9:.3f} s" for pair, ns in in_flight)
            prediction = Prediction(
                f"no serial I/O in {name}", step_s, step_s - parts.serial_io_ns / 1e9, "that time removed"
            )
            out.append(
                Finding(
                    f"serial I/O in {name}",
                    parts.serial_io_ns / 1e9,
                    f"I/O ran while the thread neither computed nor recorded a wait ({pairs})",
                    "unknown: the engine waits there without recording a stall",
                    prediction,
                )
            )
    out += _disk_and_pool(b, summary, facts, remedies)
    out = [f for f in out if f.prediction.saving_s >= MIN_SAVING_SHARE * step_s]
    return sorted(out, key=lambda f: -f.prediction.saving_s)


def disk_use(m: StepParts, facts: RunFacts) -> float | None:
    """The speed the step's NVMe traffic ran at, as a share of the probed disk's: its reads at the probed read
    speed plus its writes at the probed write speed, over the time either was in flight. Reads and writes share
    one disk, so each direction alone looks slow while the other runs. None when the disk was not probed (or
    not with direct I/O) or the step moved too little to say."""
    raw_r, raw_w = facts.raw(True), facts.raw(False)
    reads = sum(p.nvme("read") for p in m.phases.values())
    writes = sum(p.nvme("write") for p in m.phases.values())
    busy_ns = sum(p.disk_busy_ns for p in m.phases.values())
    if not (raw_r and raw_w) or reads + writes < MIN_DISK_BYTES or not busy_ns:
        return None
    return (reads / raw_r + writes / raw_w) / busy_ns  # time at the probed speed / time it took


def _disk_and_pool(b: Breakdown, summary: Summary, facts: RunFacts, remedies: dict) -> list[Finding]:
    m, out = b.mean, []
    step_s = m.wall_ns / 1e9
    raw_r, raw_w = facts.raw(True), facts.raw(False)
    reads = sum(p.nvme("read") for p in m.phases.values())
    writes = sum(p.nvme("write") for p in m.phases.values())
    busy_ns = sum(p.disk_busy_ns for p in m.phases.values())
    fraction = disk_use(m, facts)
    if fraction is not None and fraction < DISK_FRACTION:
        r = remedies.get(("disk", "read")) or remedies.get(("disk", "write")) or NO_SETTING
        rates = ", ".join(
            f"{what} at {nbytes / busy:.2f} GB/s of the probed {raw:.2f}"
            for what, nbytes, busy, raw in (
                ("reads", reads, sum(p.read_busy_ns for p in m.phases.values()), raw_r),
                ("writes", writes, sum(p.write_busy_ns for p in m.phases.values()), raw_w),
            )
            if nbytes and busy
        )
        prediction = disk_at_raw(b, fraction, r.action if r.setting else "NVMe at the probed speed")
        out.append(
            Finding(
                "NVMe below the disk's speed",
                prediction.saving_s / (1 - fraction),  # the time the thread was exposed to the disk
                f"the disk moved its bytes in {busy_ns / 1e9:.3f} s per step, {fraction:.2f} of its probed speed "
                f"({rates} GB/s while busy)",
                r.action,
                prediction,
                r.setting,
            )
        )
    for pool, (count, wait_ns) in sorted(summary.pools.items()):
        per_step_s = wait_ns / 1e9 / max(1, b.rank_steps)
        if per_step_s <= 0:
            continue
        r = remedies.get(("pool", pool), NO_SETTING)
        out.append(
            Finding(
                f"buffer pool '{pool}' waits",
                per_step_s,
                f"exhausted {count} times",
                r.action,
                Prediction(f"no '{pool}' pool waits", step_s, step_s - per_step_s, "the waits removed"),
                r.setting,
            )
        )
    return out
