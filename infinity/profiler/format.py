"""The swap-trace format, version 2: one JSON-lines file per rank, written while the run goes.

Files: `<profiler.path>/trace_rank{r}.jsonl`, one JSON object per line, appended in batches (at
least at every step end), so a crashed run leaves every line but the last few and at most one cut
last line, which readers skip. Times are integer nanoseconds of `time.perf_counter_ns()` in the
writing process: monotonic within one file, comparable across files only through the meta line's
`t0_ns` / `t0_unix_ns` pair. Bytes are integers; GB means 1e9 bytes. Every record has `type`, and
every line ends with its checksum, `"crc32"`, which readers check (`encoding.seal`; version 1 lines have none).

Records (required fields; `step` / `phase` are the step number and phase when the event was written):

- `meta` (first line): `version`, `rank`, `world_size`, `t0_ns` (perf_counter_ns when the file was
  opened), `t0_unix_ns` (time.time_ns() at the same moment), `settings` (`stage3_prefetch_bucket_size`,
  `stage3_max_live_parameters`, `offload_param` {device, buffer_count, buffer_size, max_in_cpu},
  `offload_optimizer` {device, buffer_count}, `aio` {block_size, queue_depth, intra_op_parallelism}),
  `raw_disk` (what a direct-I/O probe of the swap directory measured, see `disk_probe`: {read_gbps,
  write_gbps, probe_bytes, backend, path}, or null), optional `config` (the run's whole resolved config,
  `InfinityConfig.to_dict()`: `gradient_clipping`, `fp16`, offload devices, budgets...).
- `step`: `step`, `start_ns`, `end_ns` — written when the step ends (a crashed step has none).
- `phase`: `step`, `phase`, `start_ns`, `end_ns` — one span of a phase; a step with gradient
  accumulation has several spans of "forward" and "backward".
- `move`: `key`, `block`, `bytes`, `src`, `dst`, `start_ns`, `end_ns`, `step`, `phase` — bytes of one
  shard moved between tiers ("device", "host", "nvme"); moves of one tier pair may overlap (several
  requests in flight). `kind_of_key(key)` says whose bytes they are (MOVE_KINDS).
- `stall`: `block`, `start_ns`, `end_ns`, `waited_on`, `step`, `phase` — the training thread (a block's
  compute, or the optimizer step) waiting; `waited_on` is a WAIT_KINDS value: a tier pair
  ("nvme->host": a disk read, "host->device": a copy to the device, ...), a collective op, "pool", or
  "optimizer step" (in forward or backward, a wait for the state reads or writes of an optimizer step
  running there).
- `collective`: `op` ("all-gather", "reduce-scatter", "all-reduce", "broadcast"), `block`, `bytes`,
  `start_ns`, `end_ns`, `step`, `phase`. Never in a one-rank trace: a collective over one rank is a view.
- `compute`: `block`, `start_ns`, `end_ns`, `step`, `phase` — the compute span of a block (forward,
  backward) or of one shard's optimizer arithmetic (in the optimizer phase, or in forward or backward
  where no block's span covers it).
- `prefetch`: `block`, `issued_ns`, `step`, `phase` — a gather or load issued ahead of use.
- `use`: `block`, `t_ns`, `ready`, `step`, `phase` — compute reached the block; `ready` is true when its
  weights were already there (prefetch hit rate = ready uses / uses).
- `pool`: `pool` ("param", "optimizer", ...), `event` ("exhausted"), `wait_ns`, `t_ns`, `step` — a
  buffer pool had no free buffer and the caller waited `wait_ns`.
- `live`: `tier`, `bytes`, `t_ns` — live bytes on a tier (the store's `live_bytes(tier)`) after a change
  (the writer repeats the last known values at each step start, so every step carries its starting level).
- `held` (optional): `tier`, `holder`, `bytes`, `t_ns` — of the tier's live bytes, those held for
  `holder` (HOLDERS) after a change.
- `peak` (optional): `tier`, `bytes`, `step`, `t_ns` — the store's high-water mark of `tier` over step
  `step` (reset at the step's start), written at the step's end: the reference the `live` series must reach.
- `rss` (optional): `bytes`, `t_ns` — the process's resident set size, sampled at step and phase changes.
- `queue` (optional): `stream` ("nvme-read", "nvme-write"), `depth` (requests in flight), `t_ns`.

Per rank, spans of `compute` never overlap each other, nor do spans of `stall`, `step` or `phase`
(see `analysis.validate`). Readers ignore unknown fields and unknown record types; a new required
field or a changed meaning raises `VERSION`. FORMAT.md next to this file has the same spec with examples.
"""

from __future__ import annotations

import json
from typing import Any

VERSION = 2  # 2: every line carries its CRC-32 (`encoding.seal`); version 1 lines carry none and are read unchecked
READABLE_VERSIONS = (1, 2)
TIERS = ("device", "host", "nvme")
PHASES = ("forward", "backward", "optimizer")
COLLECTIVE_OPS = ("all-gather", "reduce-scatter", "all-reduce", "broadcast")
QUEUE_STREAMS = ("nvme-read", "nvme-write")
POOL_EVENTS = ("exhausted",)
TIER_PAIRS = tuple(f"{a}->{b}" for a in TIERS for b in TIERS if a != b)
# "optimizer step": a wait inside forward or backward for the reads or writes of an optimizer step running
# there (deferred to the next forward, or stepping shards as their gradients arrive)
OPTIMIZER_STEP_WAIT = "optimizer step"
WAIT_KINDS = TIER_PAIRS + COLLECTIVE_OPS + ("pool", OPTIMIZER_STEP_WAIT)

# What a wait was on, in words; `wait_group(waited_on)` maps each WAIT_KINDS value to one of these.
DISK_READ, DISK_WRITE, TO_DEVICE, TO_HOST, COLLECTIVE, REDUCTION, POOL, OPTIMIZER_STEP = (
    "disk read",
    "disk write",
    "host-to-device copy",
    "device-to-host copy",
    "collective",  # a gather's (all-gather, broadcast)
    "gradient reduction",  # reduce-scatter, all-reduce: waiting for the slowest rank's gradients
    "buffer pool",
    "optimizer step",
)
WAIT_GROUPS = (DISK_READ, DISK_WRITE, TO_DEVICE, TO_HOST, COLLECTIVE, REDUCTION, POOL, OPTIMIZER_STEP)
REDUCTION_OPS = ("reduce-scatter", "all-reduce")

# Whose bytes a move carries, from its store key's last part: ('h.0#0', 'param'), ('h.0#0', 'exp_avg').
MOVE_KINDS = ("param", "optimizer", "grad", "other")
_KEY_KINDS = {"param": "param", "grad": "grad"} | dict.fromkeys(("master", "exp_avg", "exp_avg_sq"), "optimizer")

# Who holds a tier's live bytes (`held` records).
HOLDERS = ("param", "optimizer", "grad", "staging", "other")

# The parts a phase's wall time is split into (see `breakdown`): the training thread computing, waiting
# (a stall), or doing neither while I/O runs that nothing overlaps (serial I/O), or none of these (other).
COMPUTE, STALL, SERIAL_IO, OTHER = "compute", "stall", "serial I/O", "other"
PARTS = (COMPUTE, STALL, SERIAL_IO, OTHER)

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
    "held": {"tier": str, "holder": str, "bytes": int, "t_ns": int},
    "peak": {"tier": str, "bytes": int, "step": int, "t_ns": int},
    "rss": {"bytes": int, "t_ns": int},
}
SPAN_TYPES = ("step", "phase", "move", "stall", "collective", "compute")
# Meta fields a reader cannot do without (the rank and its clock), and those that must have this type where
# present (the version is checked by `analysis.validate`, which reports a mismatch as a problem).
META_REQUIRED = ("rank", "t0_ns")
META_TYPES: dict[str, type] = {"rank": int, "world_size": int, "t0_ns": int, "t0_unix_ns": int, "settings": dict,
                               "raw_disk": dict}  # fmt: skip
SETTINGS_SECTIONS = ("offload_param", "offload_optimizer", "aio")
_JSON_TYPE = {int: "an integer", dict: "a JSON object"}


def meta_problem(meta: dict[str, Any]) -> str | None:
    """Why the meta line `meta` cannot be read (a field the reader needs is missing or of the wrong type), or
    None. Null optional fields are fine; `settings` and its sections must be objects where present."""
    for name in META_REQUIRED:
        if meta.get(name) is None:
            return f"the meta line has no {name!r}"
    fields = [(name, meta.get(name), kind) for name, kind in META_TYPES.items()]
    settings = meta.get("settings")
    if isinstance(settings, dict):
        fields += [(f"settings.{name}", settings.get(name), dict) for name in SETTINGS_SECTIONS]
    for name, value, kind in fields:
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            return f"the meta line's {name!r} is {shown}, needs {_JSON_TYPE[kind]}"
    return None


def trace_filename(rank: int) -> str:
    """The file name of rank `rank`'s trace inside the profiler path."""
    return f"trace_rank{rank}.jsonl"


def tier_pair(src: str, dst: str) -> str:
    """The name of a tier pair as records and reports spell it: "nvme->host"."""
    return f"{src}->{dst}"


def wait_group(waited_on: str) -> str:
    """What a stall's `waited_on` was, in words: "disk read", "host-to-device copy", "collective", ..."""
    if waited_on in REDUCTION_OPS:
        return REDUCTION
    if waited_on in COLLECTIVE_OPS:
        return COLLECTIVE
    if waited_on == "pool":
        return POOL
    if waited_on == OPTIMIZER_STEP_WAIT:
        return OPTIMIZER_STEP
    src, _, dst = waited_on.partition("->")
    if src == "nvme":
        return DISK_READ
    if dst == "nvme":
        return DISK_WRITE
    return TO_DEVICE if dst == "device" else TO_HOST


def kind_of_key(key: str) -> str:
    """Whose bytes a move of store key `key` (as written: "('h.0#0', 'exp_avg')") carries: a MOVE_KINDS value."""
    last = key.rstrip(")]").rsplit(",", 1)[-1].strip(" '\"([")
    return _KEY_KINDS.get(last, "other")


def gather_source(settings: dict[str, Any]) -> str:
    """The tier pair a one-rank gather waits on: the first move that brings a parameter shard toward compute."""
    device = (settings.get("offload_param") or {}).get("device")
    return "nvme->host" if device == "nvme" else "host->device"


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
        },
        "aio": {
            "block_size": aio.block_size,
            "queue_depth": aio.queue_depth,
            "intra_op_parallelism": aio.intra_op_parallelism,
        },
    }
