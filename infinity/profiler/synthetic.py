"""Synthetic swap traces from a toy timeline, for tests and for trying the report without a run.

A `Scenario` plays a model of `blocks` equal blocks on a disk with one read queue and one write
queue (reads run one after another at `read_gbps`, writes at `write_gbps`, the two side by side).
Forward and backward read each block's parameter shard from NVMe `prefetch_ahead` blocks ahead of
compute (0: on use), gather it and compute. The optimizer's state (`optim_bytes` per block, read and
written back) streams as infinity's NVMe optimizer does: without clipping or fp16 each block's state
is read when its gradient arrives and the block is stepped `window // 2` blocks later, inside
backward; with `gradient_clipping` (or fp16) each gradient is written to NVMe in backward and the
whole optimizer runs after backward, `window` shards read ahead. The last forward block stays
gathered for backward; the last state writes finish in the next step. Host memory is tracked per
holder (`held`), with every change (`live`) and the step's peak (`peak`). Nothing here is measured:
it exists to give the report known inputs.
`python -m infinity.profiler.synthetic DIR [starved|tuned|clipped|...]` writes one.
"""

from __future__ import annotations

import dataclasses
import heapq
import sys
import time
from dataclasses import dataclass

from infinity.profiler.format import COLLECTIVE_OPS
from infinity.profiler.writer import TraceWriter

MS = 1_000_000


@dataclass(frozen=True)
class Scenario:
    blocks: int = 16
    block_bytes: int = 64_000_000
    forward_ms: float = 40.0
    backward_ms: float = 80.0
    gather_ms: float = 1.0
    read_gbps: float = 1.8
    write_gbps: float = 0.9
    prefetch_ahead: int = 2
    queue_depth: int = 8  # aio.queue_depth; the queue holds this many requests while a transfer runs
    buffer_count: int = 5
    pool_exhausted_per_step: int = 0
    pool_wait_ms: float = 2.0
    stall_on: str = "nvme->host"  # what a late block is recorded as waiting on; a collective: the gather is late
    raw_read_gbps: float | None = 2.0
    raw_write_gbps: float | None = 1.0
    steps: int = 3
    optim_bytes: int = 48_000_000  # optimizer state (master, moments) of one block, read and written per step
    grad_bytes: int = 16_000_000  # one block's fp32 gradient shard
    adam_ms: float = 4.0  # the optimizer's arithmetic for one block
    window: int = 4  # offload_optimizer.buffer_count
    gradient_clipping: float = 0.0
    fp16: bool = False
    host_budget_bytes: int | None = None


SCENARIOS = {
    "tuned": Scenario(),
    "clipped": Scenario(gradient_clipping=1.0),
    "starved": Scenario(
        prefetch_ahead=0,
        queue_depth=1,
        buffer_count=1,
        read_gbps=0.25,
        write_gbps=0.12,
        pool_exhausted_per_step=40,
        optim_bytes=2_000_000,
    ),
    "late_prefetch": Scenario(prefetch_ahead=0),
    "disk_bound": Scenario(forward_ms=20.0, backward_ms=20.0, prefetch_ahead=3),
    "slow_disk": Scenario(read_gbps=0.5, write_gbps=0.3, forward_ms=200.0, backward_ms=200.0),
    "gather_bound": Scenario(stall_on="all-gather", gather_ms=30.0),
}


def config_for(s: Scenario) -> dict:
    """The part of a resolved config (`InfinityConfig.to_dict()`) the diagnosis reads, for scenario `s`."""
    return {
        "gradient_clipping": s.gradient_clipping,
        "fp16": {"enabled": s.fp16},
        "bf16": {"enabled": not s.fp16},
        "zero_optimization": {
            "stage": 3,
            "stage3_prefetch_bucket_size": 50_000_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "host_budget_bytes": s.host_budget_bytes,
            "device_budget_bytes": None,
            "offload_param": {
                "device": "nvme",
                "nvme_path": "/nvme",
                "buffer_count": s.buffer_count,
                "buffer_size": 100_000_000,
                "max_in_cpu": 1_000_000_000,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": s.window},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": s.queue_depth, "intra_op_parallelism": 1},
    }


def settings_for(s: Scenario) -> dict:
    """The meta settings of a scenario (DeepSpeed defaults for what it does not vary)."""
    c = config_for(s)
    z = c["zero_optimization"]
    return {
        "stage3_prefetch_bucket_size": z["stage3_prefetch_bucket_size"],
        "stage3_max_live_parameters": z["stage3_max_live_parameters"],
        "offload_param": {k: v for k, v in z["offload_param"].items() if k != "nvme_path"},
        "offload_optimizer": {"device": "nvme", "buffer_count": s.window},
        "aio": c["aio"],
    }


def key(block: int, name: str) -> str:
    """A store key as the engine's moves spell it."""
    return str((f"block{block}#0", name))


class _Host:
    """Host memory per holder: every change is a `live` and a `held` record; frees may be scheduled ahead."""

    def __init__(self, w: TraceWriter) -> None:
        self.w, self.held, self.pending, self.peak = w, {}, [], 0

    def change(self, holder: str, nbytes: int, t: int) -> None:
        self.settle(t)
        self.held[holder] = self.held.get(holder, 0) + nbytes
        total = sum(self.held.values())
        self.peak = max(self.peak, total)
        self.w.held("host", holder, self.held[holder], t)
        self.w.live("host", total, t)

    def free_at(self, holder: str, nbytes: int, t: int) -> None:
        heapq.heappush(self.pending, (t, holder, nbytes))

    def settle(self, t: int) -> None:
        while self.pending and self.pending[0][0] <= t:
            when, holder, nbytes = heapq.heappop(self.pending)
            self.held[holder] -= nbytes
            self.w.held("host", holder, self.held[holder], when)
            self.w.live("host", sum(self.held.values()), when)


class _Run:
    """One rank's timeline: the disk queue, host memory, and the training thread's clock `t`."""

    def __init__(self, w: TraceWriter, s: Scenario, t: int, world_size: int) -> None:
        self.w, self.s, self.t, self.world_size = w, s, t, world_size
        self.disk_free = {"read": t, "write": t}
        self.host = _Host(w)
        self.overlap = s.gradient_clipping <= 0 and not s.fp16

    def transfer(self, block: int, name: str, nbytes: int, src: str, dst: str, at: int) -> int:
        queue = "read" if src == "nvme" else "write"
        start = max(at, self.disk_free[queue])
        gbps = self.s.read_gbps if src == "nvme" else self.s.write_gbps
        end = self.disk_free[queue] = start + int(nbytes / gbps)
        stream = "nvme-read" if src == "nvme" else "nvme-write"
        self.w.queue(stream, self.s.queue_depth, start)
        self.w.move(key(block, name), f"block{block}", nbytes, src, dst, start, end)
        self.w.queue(stream, 0, end)
        return end

    def wait(self, block: int, ready: int, on: str) -> None:
        if ready > self.t:
            self.w.stall(f"block{block}", self.t, ready, on)
            self.t = ready

    def read_param(self, block: int) -> int:
        self.host.change("param", self.s.block_bytes, self.t)
        return self.transfer(block, "param", self.s.block_bytes, "nvme", "host", self.t)

    def compute_pass(self, order: list[int], compute_ms: float, backward: bool, arrived: list) -> None:
        s, w = self.s, self.w
        ready: dict[int, int] = {order[0]: self.t} if backward else {}  # forward's last block is still there
        for i in order[: s.prefetch_ahead]:
            if i not in ready:
                w.prefetch(f"block{i}", self.t)
                ready[i] = self.read_param(i)
        for n, i in enumerate(order):
            if i not in ready:
                ready[i] = self.read_param(i)
            w.use(f"block{i}", ready[i] <= self.t, self.t)
            self.wait(i, ready[i], s.stall_on if s.stall_on not in COLLECTIVE_OPS else "nvme->host")
            if s.prefetch_ahead and n + s.prefetch_ahead < len(order) and order[n + s.prefetch_ahead] not in ready:
                nxt = order[n + s.prefetch_ahead]
                w.prefetch(f"block{nxt}", self.t)
                ready[nxt] = self.read_param(nxt)
            gathered = self.t + int(s.gather_ms * MS)
            if self.world_size > 1:
                w.collective("all-gather", f"block{i}", s.block_bytes * self.world_size, self.t, gathered)
                if s.stall_on in COLLECTIVE_OPS:
                    w.stall(f"block{i}", self.t, gathered, s.stall_on)
            start, self.t = gathered, gathered + int(compute_ms * MS)
            w.compute(f"block{i}", start, self.t)
            if backward or n < len(order) - 1:  # the last forward block is kept for backward
                self.host.change("param", -s.block_bytes, self.t)
            if backward:
                self.grad_arrived(i, arrived)

    def grad_arrived(self, block: int, arrived: list) -> None:
        s = self.s
        if not self.overlap:  # the gradient goes to its NVMe slot until the optimizer phase
            self.host.change("grad", s.grad_bytes, self.t)
            done = self.transfer(block, "grad", s.grad_bytes, "host", "nvme", self.t)
            self.host.free_at("grad", s.grad_bytes, done)
            return
        self.host.change("optimizer", s.optim_bytes, self.t)
        arrived.append((block, self.transfer(block, "exp_avg", s.optim_bytes, "nvme", "host", self.t)))
        while len(arrived) > max(1, s.window // 2):
            self.step_block(*arrived.pop(0))

    def step_block(self, block: int, state_ready: int) -> None:
        s = self.s
        self.wait(block, state_ready, "nvme->host")
        start, self.t = self.t, self.t + int(s.adam_ms * MS)
        self.w.compute(f"block{block}", start, self.t)
        done = self.transfer(block, "exp_avg", s.optim_bytes, "host", "nvme", self.t)
        self.host.free_at("optimizer", s.optim_bytes, done)

    def optimizer_phase(self, arrived: list) -> None:
        s = self.s
        for n in range(s.pool_exhausted_per_step):
            self.w.pool_exhausted("param", int(s.pool_wait_ms * MS), self.t + n)
        if self.overlap:
            while arrived:
                self.step_block(*arrived.pop(0))
        else:
            reads: list[tuple[int, int]] = []
            for i in range(s.blocks):
                while len(reads) < s.window and len(reads) + i < s.blocks:
                    nxt = i + len(reads)
                    self.host.change("optimizer", s.optim_bytes + s.grad_bytes, self.t)
                    self.transfer(nxt, "grad", s.grad_bytes, "nvme", "host", self.t)
                    reads.append((nxt, self.transfer(nxt, "exp_avg", s.optim_bytes, "nvme", "host", self.t)))
                block, ready = reads.pop(0)
                self.host.free_at("optimizer", s.grad_bytes, ready)
                self.step_block(block, ready)
        self.host.settle(self.t)  # the last writes finish behind the next step's start


def write_scenario(path: str, s: Scenario, rank: int = 0, world_size: int = 1) -> str:
    """Write rank `rank`'s trace of scenario `s` into directory `path`; returns the file's path."""
    raw = None
    if s.raw_read_gbps is not None:
        raw = {"read_gbps": s.raw_read_gbps, "write_gbps": s.raw_write_gbps, "backend": "odirect"}
    with TraceWriter(path, rank, world_size, settings_for(s), raw_disk=raw, config=config_for(s)) as w:
        run = _Run(w, s, time.perf_counter_ns(), world_size)
        w.live("host", 0, run.t)
        for step in range(s.steps):
            w.begin_step(step, run.t)
            run.host.peak = sum(run.host.held.values())
            arrived: list[tuple[int, int]] = []
            blocks = list(range(s.blocks))
            run.compute_pass(blocks, s.forward_ms, False, arrived)
            w.set_phase("backward", run.t)
            run.compute_pass(blocks[::-1], s.backward_ms, True, arrived)
            w.set_phase("optimizer", run.t)
            run.optimizer_phase(arrived)
            w.peak("host", run.host.peak, run.t)
            w.end_step(step, run.t)
        return w.path


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2 or (len(argv) == 2 and argv[1] not in SCENARIOS):
        print(f"usage: python -m infinity.profiler.synthetic DIR [{'|'.join(SCENARIOS)}]", file=sys.stderr)
        return 2
    scenario = SCENARIOS[argv[1] if len(argv) == 2 else "starved"]
    print(write_scenario(argv[0], dataclasses.replace(scenario)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
