"""The swap-trace format, version 1: one JSON-lines file per rank, written while the run goes.

Files: `<profiler.path>/trace_rank{r}.jsonl`, one JSON object per line, appended in batches (at
least at every step end), so a crashed run leaves every line but the last few and at most one cut
last line, which readers skip. Times are integer nanoseconds of `time.perf_counter_ns()` in the
writing process: monotonic within one file, comparable across files only through the meta line's
`t0_ns` / `t0_unix_ns` pair. Bytes are integers; GB means 1e9 bytes. Every record has `type`.

Records (required fields; `step` / `phase` are the step number and phase when the event was written):

- `meta` (first line): `version`, `rank`, `world_size`, `t0_ns` (perf_counter_ns when the file was
  opened), `t0_unix_ns` (time.time_ns() at the same moment), `settings` (`stage3_prefetch_bucket_size`,
  `stage3_max_live_parameters`, `offload_param` {device, buffer_count, buffer_size, max_in_cpu},
  `offload_optimizer` {device, buffer_count, pipeline_read, pipeline_write}, `aio` {block_size,
  queue_depth, intra_op_parallelism}), `raw_disk` ({read_gbps, write_gbps} per rank, or null).
- `step`: `step`, `start_ns`, `end_ns` — written when the step ends (a crashed step has none).
- `phase`: `step`, `phase`, `start_ns`, `end_ns` — one span of a phase; a step with gradient
  accumulation has several spans of "forward" and "backward".
- `move`: `key`, `block`, `bytes`, `src`, `dst`, `start_ns`, `end_ns`, `step`, `phase` — bytes of one
  shard moved between tiers ("device", "host", "nvme"); moves of one tier pair may overlap (several
  requests in flight).
- `stall`: `block`, `start_ns`, `end_ns`, `waited_on`, `step`, `phase` — compute waiting for a block;
  `waited_on` is a tier pair ("nvme->host", "host->device", ...), a collective op, or "pool".
- `collective`: `op` ("all-gather", "reduce-scatter", "all-reduce", "broadcast"), `block`, `bytes`,
  `start_ns`, `end_ns`, `step`, `phase`.
- `compute`: `block`, `start_ns`, `end_ns`, `step`, `phase` — the compute span of a block.
- `prefetch`: `block`, `issued_ns`, `step`, `phase` — a gather or load issued ahead of use.
- `use`: `block`, `t_ns`, `ready`, `step`, `phase` — compute reached the block; `ready` is true when its
  weights were already there (prefetch hit rate = ready uses / uses).
- `pool`: `pool` ("param", "optimizer", ...), `event` ("exhausted"), `wait_ns`, `t_ns`, `step` — a
  buffer pool had no free buffer and the caller waited `wait_ns`.
- `live`: `tier`, `bytes`, `t_ns` — live bytes on a tier after a change (the writer repeats the
  last known values at each step start, so every step carries its starting level).
- `queue` (optional): `stream` ("nvme-read", "nvme-write"), `depth` (requests in flight), `t_ns`.

Per rank, spans of `compute` never overlap each other, nor do spans of `stall`, `step` or `phase`
(see `analysis.validate`). Readers ignore unknown fields and unknown record types; a new required
field or a changed meaning raises `VERSION`. FORMAT.md next to this file has the same spec with examples.
"""

from __future__ import annotations

from typing import Any

VERSION = 1
TIERS = ("device", "host", "nvme")
PHASES = ("forward", "backward", "optimizer")
COLLECTIVE_OPS = ("all-gather", "reduce-scatter", "all-reduce", "broadcast")
QUEUE_STREAMS = ("nvme-read", "nvme-write")
POOL_EVENTS = ("exhausted",)
TIER_PAIRS = tuple(f"{a}->{b}" for a in TIERS for b in TIERS if a != b)
WAIT_KINDS = TIER_PAIRS + COLLECTIVE_OPS + ("pool",)

# Required fields per record type and the Python types their values must have.
_SPAN = {"start_ns": int, "end_ns": int}
_WHEN = {"step": int, "phase": str}
FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "meta": {"version": int, "rank": int, "world_size": int, "t0_ns": int, "settings": dict},
    "step": {"step": int, **_SPAN},
    "phase": {"step": int, "phase": str, **_SPAN},
    "move": {"key": str, "block": str, "bytes": int, "src": str, "dst": str, **_SPAN, **_WHEN},
    "stall": {"block": str, "waited_on": str, **_SPAN, **_WHEN},
    "collective": {"op": str, "block": str, "bytes": int, **_SPAN, **_WHEN},
    "compute": {"block": str, **_SPAN, **_WHEN},
    "prefetch": {"block": str, "issued_ns": int, **_WHEN},
    "use": {"block": str, "t_ns": int, "ready": bool, **_WHEN},
    "pool": {"pool": str, "event": str, "wait_ns": int, "t_ns": int, "step": int},
    "live": {"tier": str, "bytes": int, "t_ns": int},
    "queue": {"stream": str, "depth": int, "t_ns": int},
}
SPAN_TYPES = ("step", "phase", "move", "stall", "collective", "compute")


def trace_filename(rank: int) -> str:
    """The file name of rank `rank`'s trace inside the profiler path."""
    return f"trace_rank{rank}.jsonl"


def tier_pair(src: str, dst: str) -> str:
    """The name of a tier pair as records and reports spell it: "nvme->host"."""
    return f"{src}->{dst}"


def settings_from_config(config: Any) -> dict[str, Any]:
    """The meta line's `settings` from an `InfinityConfig` (read by attribute; nothing is imported)."""
    zero, aio = config.zero_optimization, config.aio
    param, optim = zero.offload_param, zero.offload_optimizer
    return {
        "stage3_prefetch_bucket_size": zero.stage3_prefetch_bucket_size,
        "stage3_max_live_parameters": zero.stage3_max_live_parameters,
        "offload_param": {
            "device": param.device,
            "buffer_count": param.buffer_count,
            "buffer_size": param.buffer_size,
            "max_in_cpu": param.max_in_cpu,
        },
        "offload_optimizer": {
            "device": optim.device,
            "buffer_count": optim.buffer_count,
            "pipeline_read": optim.pipeline_read,
            "pipeline_write": optim.pipeline_write,
        },
        "aio": {
            "block_size": aio.block_size,
            "queue_depth": aio.queue_depth,
            "intra_op_parallelism": aio.intra_op_parallelism,
        },
    }
