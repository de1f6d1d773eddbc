"""Synthetic swap traces from a toy timeline, for tests and for trying the report without a run.

A `Scenario` plays a model of `blocks` equal blocks whose shards are read from NVMe one at a time at
`read_gbps`, `prefetch_ahead` blocks ahead of compute (0: read on use), then gathered and computed;
the optimizer writes every shard back at `write_gbps`. Nothing here is measured: it exists to give
the report known inputs. `python -m infinity.profiler.synthetic DIR [starved|tuned|...]` writes one.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass

from infinity.profiler.writer import TraceWriter

MS = 1_000_000


@dataclass(frozen=True)
class Scenario:
    blocks: int = 8
    block_bytes: int = 64_000_000
    forward_ms: float = 40.0
    backward_ms: float = 80.0
    gather_ms: float = 1.0
    read_gbps: float = 1.8
    write_gbps: float = 0.9
    prefetch_ahead: int = 2
    queue_depth: int = 8  # aio.queue_depth; the queue holds this many requests while a read runs
    buffer_count: int = 5
    pool_exhausted_per_step: int = 0
    pool_wait_ms: float = 2.0
    stall_on: str = "nvme->host"  # what a late block is recorded as waiting on
    raw_read_gbps: float | None = 2.0
    raw_write_gbps: float | None = 1.0
    steps: int = 3


SCENARIOS = {
    "tuned": Scenario(),
    "starved": Scenario(
        prefetch_ahead=0, queue_depth=1, buffer_count=1, read_gbps=0.25, write_gbps=0.12, pool_exhausted_per_step=40
    ),
    "late_prefetch": Scenario(prefetch_ahead=0),
    "disk_bound": Scenario(forward_ms=20.0, backward_ms=20.0, prefetch_ahead=3),
    "slow_disk": Scenario(read_gbps=0.5, write_gbps=0.3, forward_ms=200.0, backward_ms=200.0),
    "gather_bound": Scenario(stall_on="all-gather", prefetch_ahead=0),
}


def settings_for(s: Scenario) -> dict:
    """The meta settings of a scenario (DeepSpeed defaults for what it does not vary)."""
    return {
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "offload_param": {
            "device": "nvme",
            "buffer_count": s.buffer_count,
            "buffer_size": 100_000_000,
            "max_in_cpu": 1_000_000_000,
        },
        "offload_optimizer": {"device": "nvme", "buffer_count": 4, "pipeline_read": False, "pipeline_write": False},
        "aio": {"block_size": 1 << 20, "queue_depth": s.queue_depth, "intra_op_parallelism": 1},
    }


class _Disk:
    """One NVMe queue: transfers run one after another."""

    def __init__(self, w: TraceWriter, s: Scenario, t: int) -> None:
        self.w, self.s, self.free = w, s, t

    def transfer(self, key: str, block: str, src: str, dst: str, at: int, gbps: float) -> int:
        start = max(at, self.free)
        end = self.free = start + int(self.s.block_bytes / gbps)
        stream = "nvme-read" if src == "nvme" else "nvme-write"
        self.w.queue(stream, self.s.queue_depth, start)
        self.w.move(key, block, self.s.block_bytes, src, dst, start, end)
        self.w.queue(stream, 0, end)
        return end


def _pass(
    w: TraceWriter, s: Scenario, disk: _Disk, t: int, order: list[int], compute_ms: float, live: list[int]
) -> int:
    ready: dict[int, int] = {}
    for i in order[: s.prefetch_ahead]:
        w.prefetch(f"block{i}", t)
        ready[i] = disk.transfer(f"block{i}/param", f"block{i}", "nvme", "host", t, s.read_gbps)
    for n, i in enumerate(order):
        name = f"block{i}"
        if i not in ready:
            ready[i] = disk.transfer(f"{name}/param", name, "nvme", "host", t, s.read_gbps)
        w.use(name, ready[i] <= t, t)
        if ready[i] > t:
            w.stall(name, t, ready[i], s.stall_on)
            t = ready[i]
        if s.prefetch_ahead and n + s.prefetch_ahead < len(order):
            nxt = order[n + s.prefetch_ahead]
            w.prefetch(f"block{nxt}", t)
            ready[nxt] = disk.transfer(f"block{nxt}/param", f"block{nxt}", "nvme", "host", t, s.read_gbps)
        live[0] += s.block_bytes
        w.live("host", live[0], t)
        gathered = t + int(s.gather_ms * MS)
        w.collective("all-gather", name, s.block_bytes, t, gathered)
        t = gathered + int(compute_ms * MS)
        w.compute(name, gathered, t)
        live[0] -= s.block_bytes
        w.live("host", live[0], t)
    return t


def write_scenario(path: str, s: Scenario, rank: int = 0, world_size: int = 1) -> str:
    """Write rank `rank`'s trace of scenario `s` into directory `path`; returns the file's path."""
    raw = None if s.raw_read_gbps is None else {"read_gbps": s.raw_read_gbps, "write_gbps": s.raw_write_gbps}
    with TraceWriter(path, rank, world_size, settings_for(s), raw_disk=raw) as w:
        t = time.perf_counter_ns()
        disk, live = _Disk(w, s, t), [0]
        w.live("host", 0, t)
        for step in range(s.steps):
            w.begin_step(step, t)
            blocks = list(range(s.blocks))
            t = _pass(w, s, disk, t, blocks, s.forward_ms, live)
            w.set_phase("backward", t)
            t = _pass(w, s, disk, t, blocks[::-1], s.backward_ms, live)
            w.set_phase("optimizer", t)
            for n in range(s.pool_exhausted_per_step):
                w.pool_exhausted("param", int(s.pool_wait_ms * MS), t + n)
            for i in blocks:
                t = disk.transfer(f"block{i}/param", f"block{i}", "host", "nvme", t, s.write_gbps)
            w.end_step(step, t)
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
