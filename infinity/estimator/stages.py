"""Which ZeRO stage and offload fit a machine, what each costs in traffic between ranks, and the advice.

Stages 1 and 2 keep the parameters whole on every device and move no weights between ranks but the updated
partitions after each step; stage 3 partitions them too and all-gathers each block for forward and again
for backward. Per rank and step, in ring collectives over the padded model of P_pad elements at b bytes
(communication_data_type defaults to the compute dtype), with k micro-batches per step and N ranks:
stage 1 all-reduces gradients every micro-batch (2k) and all-gathers the update (1): (2k + 1) (N-1)/N b P_pad;
stage 2 reduce-scatters instead: (k + 1) (N-1)/N b P_pad; stage 3: 3k (N-1)/N b P_pad, 1.5x stage 2 at k = 1.
Frozen parameters have no gradient and no update: stage 3 gathers them (2k), stages 1 and 2 move none.
"""

from __future__ import annotations

from dataclasses import dataclass

from infinity.estimator.layout import OFFLOAD_CHOICES, STAGE_CHOICES, MemoryNeed, estimate
from infinity.estimator.machine import Machine, describe, fits, format_bytes, shortfall
from infinity.estimator.sizes import ModelSize, size_from_params
from infinity.partition.flat_param import FlatParam

# The order advice looks for a choice that fits in: least traffic between ranks and tiers first.
_PREFERENCE: tuple[tuple[int, str, str], ...] = (
    *((2, "none", optim) for optim in ("none", "cpu", "nvme")),
    *((3, param, optim) for param, optim in OFFLOAD_CHOICES),
    *((1, "none", optim) for optim in ("none", "cpu", "nvme")),
)


def collective_bytes_per_step(
    size: ModelSize, stage: int, ranks: int, dtype_bytes: int = 2, accumulation: int = 1
) -> int:
    """Bytes each rank sends to the others per optimizer step at `stage` (see the module docstring)."""
    if ranks == 1:
        return 0

    def padded(counts: list[tuple[int, int]]) -> int:
        return sum(count * FlatParam.shard_elems(elems, ranks) * ranks for elems, count in counts)

    passes = {1: 2 * accumulation + 1, 2: accumulation + 1, 3: 3 * accumulation}[stage]
    elems = passes * padded(size.flat_counts())
    if stage == 3:  # frozen flats are gathered for forward and backward, never reduced
        elems += 2 * accumulation * padded(size.frozen_flat_counts())
    return (ranks - 1) * elems * dtype_bytes // ranks


@dataclass(frozen=True)
class StageRow:
    """One stage and offload choice on a machine: its need, whether it fits, its traffic between ranks."""

    need: MemoryNeed
    fits: bool
    collective_bytes: int

    @property
    def key(self) -> tuple[int, str, str]:
        return self.need.stage, self.need.offload_param, self.need.offload_optimizer


def stage_table(
    size: ModelSize,
    machine: Machine,
    gpus_per_node: int | None = None,
    nodes: int = 1,
    dtype_bytes: int = 2,
    *,
    moments: str = "fp32",
    clip: bool = True,
    accumulation: int = 1,
) -> list[StageRow]:
    """Every choice of STAGE_CHOICES for `size` on `machine` (gpus_per_node ranks per node: the machine's
    devices by default). Moments are fp32 where the optimizer stays on the device (compressed ones are the
    native CPU Adam's)."""
    per_node = machine.devices if gpus_per_node is None else gpus_per_node
    rows = []
    for stage, param, optim in STAGE_CHOICES:
        need = estimate(size, param, optim, per_node, nodes, dtype_bytes, stage=stage,
                        moments=moments if optim != "none" else "fp32", clip=clip, accumulation=accumulation,
                        device_is_host=machine.device_is_host)  # fmt: skip
        traffic = collective_bytes_per_step(size, stage, per_node * nodes, dtype_bytes, accumulation)
        rows.append(StageRow(need, fits(need, machine, per_node), traffic))
    return rows


@dataclass(frozen=True)
class StageAdvice:
    """A config's stage and offload on a machine: its need, whether it fits (else what it lacks), and a note
    where another stage fits better (less traffic) or where it fits and the config's choice does not."""

    need: MemoryNeed
    fits: bool
    shortfall: str | None
    note: str | None


def preferred(rows: list[StageRow]) -> StageRow | None:
    """The row that fits with the least traffic between ranks and tiers (stage 2 first, then stage 3 with the
    least offloaded, stage 1 last: it needs no less memory than stage 2 here); None if none fits."""
    by_key = {row.key: row for row in rows}
    return next((by_key[key] for key in _PREFERENCE if key in by_key and by_key[key].fits), None)


def choice_name(key: tuple[int, str, str]) -> str:
    stage, param, optim = key
    offloads = f"offload_optimizer {optim}" if stage < 3 else f"offload_param {param}, offload_optimizer {optim}"
    return f"stage {stage} ({offloads})"


def advise(
    size: ModelSize,
    machine: Machine,
    stage: int,
    offload_param: str,
    offload_optimizer: str,
    gpus_per_node: int | None = None,
    nodes: int = 1,
    dtype_bytes: int = 2,
    *,
    moments: str = "fp32",
    clip: bool = True,
    accumulation: int = 1,
) -> StageAdvice:
    """Whether the choice fits `machine`, and the note: stage 3 where stage 2 fits (stage 3 all-gathers the
    parameters twice per step, ~1.5x stage 2's traffic; with one rank, it copies offloaded parameters in
    twice per step where stage 2 keeps them resident), stage 1 where stage 2 fits (the same memory here,
    half the gradient traffic), or what fits where the choice does not, or that nothing does."""
    per_node = machine.devices if gpus_per_node is None else gpus_per_node
    ranks = per_node * nodes
    need = estimate(size, offload_param, offload_optimizer, per_node, nodes, dtype_bytes, stage=stage,
                    moments=moments, clip=clip, accumulation=accumulation,
                    device_is_host=machine.device_is_host)  # fmt: skip
    lacks = shortfall(need, machine, per_node)
    rows = stage_table(size, machine, per_node, nodes, dtype_bytes, moments=moments, clip=clip,
                       accumulation=accumulation)  # fmt: skip
    if lacks is not None:
        best = preferred(rows)
        note = (
            f"{choice_name(best.key)} fits: use it"
            if best is not None
            else "no stage or offload fits this machine: add devices or nodes, free disk, or train a smaller model"
        )
        return StageAdvice(need, False, lacks, note)
    return StageAdvice(need, True, None, _better_stage_note(rows, stage, offload_param, offload_optimizer, ranks))


def _better_stage_note(rows: list[StageRow], stage: int, param: str, optim: str, ranks: int) -> str | None:
    """Where a fitting choice moves fewer bytes: stage 2 (with `optim` where it fits) instead of 3 or 1."""
    stage2 = [row for row in rows if row.key[0] == 2 and row.fits]
    if stage == 2 or not stage2 or (ranks == 1 and (stage == 1 or param == "none")):
        return None  # one rank at stage 1, or at stage 3 without offload_param, is stage 2 already
    better = next((row for row in stage2 if row.key == (2, "none", optim)), stage2[0])
    if stage == 1:
        return (
            f"{choice_name(better.key)} fits too: it needs no more memory than stage 1 here and reduce-scatters "
            "the gradients where stage 1 all-reduces them (half the gradient traffic); set zero_optimization.stage "
            "to 2"
        )
    remove = " and remove offload_param" if param != "none" else ""
    if ranks == 1:
        return (
            f"{choice_name(better.key)} fits too and keeps the parameters resident on the device, where "
            f"offload_param {param} copies them in for forward and again for backward; set zero_optimization.stage "
            f"to 2{remove}"
        )
    mine = next(row.collective_bytes for row in rows if row.key[0] == 3)  # the same at every offload
    theirs = better.collective_bytes
    return (
        f"{choice_name(better.key)} fits too: stage 3 all-gathers the parameters twice per step, "
        f"{mine / theirs:.1f}x stage 2's traffic between ranks ({format_bytes(mine)} vs {format_bytes(theirs)} "
        f"per rank per step); set zero_optimization.stage to 2{remove}"
    )


def fit_line(advice: StageAdvice, machine: Machine, what: str) -> str:
    """One line on a config's choice (`what`: the model and ranks, as words) on this machine, the note after."""
    need = advice.need
    line = (
        f"{choice_name((need.stage, need.offload_param, need.offload_optimizer))}, moments {need.moments}, {what}: "
        f"{format_bytes(need.device_bytes)} per device, {format_bytes(need.host_bytes)} host and "
        f"{format_bytes(need.nvme_bytes)} NVMe per node; "
        + ("fits this machine" if advice.fits else f"does NOT fit this machine ({advice.shortfall})")
        + f" [{describe(machine)}]"
    )
    return line + (f". Note: {advice.note}" if advice.note else "")


def largest_fitting_params(
    machine: Machine,
    offload_param: str,
    offload_optimizer: str,
    nodes: int = 1,
    dtype_bytes: int = 2,
    **choice,
) -> int:
    """The most parameters (GPT-shaped, see `size_from_params`) whose model states fit `machine` with one rank
    per device; 0 if none. `choice`: stage, moments, clip, accumulation as for `estimate`."""

    def ok(p: int) -> bool:
        need = estimate(size_from_params(p), offload_param, offload_optimizer, machine.devices, nodes, dtype_bytes,
                        device_is_host=machine.device_is_host, **choice)  # fmt: skip
        return fits(need, machine)

    lo, hi = 0, 1
    while ok(hi) and hi < 10**16:
        lo, hi = hi, hi * 2
    while hi - lo > max(1, lo // 10_000):  # 0.01% is plenty for a capacity estimate
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
