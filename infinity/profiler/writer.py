"""TraceWriter: appends swap-trace records (see `format`) to one JSON-lines file per rank, as the run goes.

Disabled profiling costs one branch: the engine and store hold `None` instead of a writer and guard
each call with `if prof is not None:` (the store's `recorder=None` convention). An enabled writer
outside its step window [start_step, end_step] drops each event after one attribute test.

Bound and durability: at most `flush_every` records wait in memory; the buffer is written and flushed
when it fills, at every `end_step`, at `close()` and at interpreter exit, so a crashed run loses at
most the last `flush_every - 1` records. All methods are thread-safe (the store records moves from
its I/O threads). Times are `time.perf_counter_ns()`; methods that take a time default to now.

One rank: a collective over one rank is a view, not communication, so a one-rank writer drops
`collective` records and records a stall said to wait on a collective as waiting on the gather's
first move (`format.gather_source`); the analysis refines stalls from the moves that ended in them.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from infinity.profiler.encoding import encode_record, seal_object
from infinity.profiler.format import COLLECTIVE_OPS, VERSION, gather_source, trace_filename

now_ns = time.perf_counter_ns
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def block_of_key(key: Hashable) -> str:
    """The default block name of a store key: the first item of a tuple key, else the key itself, without
    the "#<param group>" suffix of a flat parameter's name ("h.0#1" -> "h.0"), as stalls name blocks."""
    name = str(key[0]) if isinstance(key, tuple) and key else str(key)
    return name.split("#", 1)[0] if "#" in name else name


def rss_bytes() -> int | None:
    """This process's resident set size (Linux /proc), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


class TraceWriter:
    """Writes rank `rank`'s trace to `<path>/trace_rank{rank}.jsonl`; usable as the store's recorder.

    Events are recorded from `begin_step(start_step)` until `end_step(end_step)`, including those
    between steps (tagged with the last step and phase). `block_of` names the block of a store key
    for `record()`. `raw_disk` is {"read_gbps", "write_gbps", ...} one rank can get from its disk (see
    `disk_probe`), or None; `config` the run's resolved config as a dict (meta `config`), or None;
    `device` the compute device's type ("cuda", "cpu"; meta `device`), or None.
    `sample_rss`: record the process's RSS at every step and phase change. Recording an event appends a
    tuple to a deque (no lock, no encoding); `flush` encodes and writes.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        rank: int,
        world_size: int,
        settings: dict[str, Any],
        start_step: int = 0,
        end_step: int = 1_000_000_000,
        raw_disk: dict[str, float] | None = None,
        block_of: Callable[[Hashable], str] = block_of_key,
        flush_every: int = 256,
        config: dict[str, Any] | None = None,
        sample_rss: bool = False,
        device: str | None = None,
    ) -> None:
        if end_step < start_step:
            raise ValueError(f"profiler end_step {end_step} is before start_step {start_step}; swap them")
        os.makedirs(path, exist_ok=True)
        self.path = os.path.join(os.fspath(path), trace_filename(rank))
        self.rank, self.step_window = rank, (start_step, end_step)
        self.block_of, self.flush_every = block_of, max(1, flush_every)
        self.one_rank = world_size == 1
        self.gather_source = gather_source(settings)  # what a one-rank gather waits on
        self.sample_rss = sample_rss and rss_bytes() is not None
        self._file = open(self.path, "w", encoding="utf-8")  # lives until close()
        self._lock = threading.Lock()  # serializes flushes; recording itself takes no lock
        self._queue: deque[tuple] = deque()
        self._quoted: dict[Any, str] = {}
        self._active = False
        self._closed = False
        self._step = -1
        self._phase = "forward"
        self._phase_start_ns = 0
        self._step_start_ns = 0
        self._live: dict[str, int] = {}
        self._open_spans = {"compute": 0, "stall": 0}  # spans the caller has begun and records at their end
        self.bad_records = 0  # records dropped at encoding for a field of the wrong type
        t0 = now_ns()
        meta = {
            "type": "meta",
            "version": VERSION,
            "rank": rank,
            "world_size": world_size,
            "t0_ns": t0,
            "t0_unix_ns": time.time_ns(),
            "settings": settings,
            "raw_disk": raw_disk,
            "start_step": start_step,
            "end_step": end_step,
        }
        if config is not None:
            meta["config"] = config
        if device is not None:
            meta["device"] = device
        self._file.write(seal_object(meta))
        self._file.flush()
        atexit.register(self.close)

    @property
    def active(self) -> bool:
        """True between begin_step(s) and end_step(s) for steps s in [start_step, end_step]."""
        return self._active

    @property
    def step(self) -> int:
        return self._step

    @property
    def phase(self) -> str:
        return self._phase

    # -- steps and phases ----------------------------------------------------------------------

    def begin_step(self, step: int, t_ns: int | None = None) -> None:
        """Start step `step` in phase "forward"; records from here on when the step is in the window."""
        first, last = self.step_window
        if not first <= step <= last or self._closed:
            return
        t = now_ns() if t_ns is None else t_ns
        self._step, self._phase = step, "forward"
        self._step_start_ns = self._phase_start_ns = t
        self._active = True
        for tier, nbytes in list(self._live.items()):  # each step carries its starting level
            self._put(("live", tier, nbytes, t))
        self._sample_rss(t)

    def set_phase(self, phase: str, t_ns: int | None = None) -> None:
        """Close the current phase span and start `phase` ("forward", "backward", "optimizer")."""
        if not self._active or phase == self._phase:
            self._phase = phase
            return
        t = now_ns() if t_ns is None else t_ns
        self._put(("phase", self._step, self._phase, self._phase_start_ns, t))
        self._phase, self._phase_start_ns = phase, t
        self._sample_rss(t)

    def end_step(self, step: int | None = None, t_ns: int | None = None) -> None:
        """End the current step: write its phase and step spans and flush; stop after `end_step`."""
        if not self._active:
            return
        t = now_ns() if t_ns is None else t_ns
        self._put(("phase", self._step, self._phase, self._phase_start_ns, t))
        self._put(("step", self._step, self._step_start_ns, t))
        self._sample_rss(t)
        self._phase_start_ns = t
        if (self._step if step is None else step) >= self.step_window[1]:
            self._active = False
        self.flush()

    # -- events --------------------------------------------------------------------------------

    def move(self, key: Hashable, block: str, nbytes: int, src: str, dst: str, start_ns: int, end_ns: int) -> None:
        """A shard's `nbytes` moved from tier `src` to tier `dst` over [start_ns, end_ns]."""
        if self._active:
            self._put(
                (
                    "move",
                    key if isinstance(key, str) else str(key),
                    block,
                    nbytes,
                    src,
                    dst,
                    start_ns,
                    end_ns,
                    self._step,
                    self._phase,
                )
            )

    def record(self, event: Any) -> None:
        """The storage recorder interface: one `MoveEvent` (key, nbytes, src, dst, start_ns, end_ns, rank)."""
        if self._active:
            key = event.key
            self._put(
                (
                    "move",
                    key if isinstance(key, str) else str(key),
                    self.block_of(key),
                    event.nbytes,
                    event.src,
                    event.dst,
                    event.start_ns,
                    event.end_ns,
                    self._step,
                    self._phase,
                )
            )

    def open_span(self, kind: str) -> None:
        """The caller has begun a `kind` ("compute" or "stall") span that it records when it ends. Until
        `close_span(kind)`, records of that kind made inside it are dropped: spans of a kind never overlap,
        and the enclosing span accounts for the time (an optimizer step run inside a gather's wait)."""
        self._open_spans[kind] += 1

    def close_span(self, kind: str) -> None:
        self._open_spans[kind] -= 1

    def stall(self, block: str, start_ns: int, end_ns: int, waited_on: str) -> None:
        """The training thread waited for `block` over [start_ns, end_ns] on `waited_on` ("nvme->host",
        "all-gather", ...; see format.WAIT_KINDS). One rank: a collective wait is the gather's first move."""
        if self._active and not self._open_spans["stall"]:
            if self.one_rank and waited_on in COLLECTIVE_OPS:
                waited_on = self.gather_source
            self._put(("stall", block, start_ns, end_ns, waited_on, self._step, self._phase))

    def collective(self, op: str, block: str, nbytes: int, start_ns: int, end_ns: int) -> None:
        """A collective `op` of `nbytes` (this rank's output buffer) for `block`; none at one rank."""
        if self._active and not self.one_rank:
            self._put(("collective", op, block, nbytes, start_ns, end_ns, self._step, self._phase))

    def compute(self, block: str, start_ns: int, end_ns: int) -> None:
        """`block` computed over [start_ns, end_ns] (its forward, or its backward, or a shard's optimizer step)."""
        if self._active and not self._open_spans["compute"]:
            self._put(("compute", block, start_ns, end_ns, self._step, self._phase))

    def prefetch(self, block: str, issued_ns: int | None = None) -> None:
        """A gather or load of `block` was issued ahead of its use."""
        if self._active:
            self._put(("prefetch", block, now_ns() if issued_ns is None else issued_ns, self._step, self._phase))

    def use(self, block: str, ready: bool, t_ns: int | None = None) -> None:
        """Compute reached `block`; `ready` when its weights were there without waiting."""
        if self._active:
            self._put(
                (
                    "use",
                    block,
                    now_ns() if t_ns is None else t_ns,
                    "true" if ready else "false",
                    self._step,
                    self._phase,
                )
            )

    def pool_exhausted(self, pool: str, wait_ns: int, t_ns: int | None = None) -> None:
        """Buffer pool `pool` ("param", "optimizer") had no free buffer; the caller waited `wait_ns`."""
        if self._active:
            self._put(("pool", pool, "exhausted", wait_ns, now_ns() if t_ns is None else t_ns, self._step))

    def memory_wait(self, tier: str, holder: str, key: Hashable | None, start_ns: int, end_ns: int) -> None:
        """The store waited over [start_ns, end_ns] for `tier` memory for `key`'s copy, held by `holder`
        ("param", "optimizer", "grad", "staging"): the budget was spent and nothing could be reclaimed. A
        `pool` exhaustion of `holder` (on the device tier, "device <holder>"); on the training thread also a
        stall on "pool" (dropped inside a stall span that covers it)."""
        pool = holder if tier == "host" else f"{tier} {holder}"
        self.pool_exhausted(pool, end_ns - start_ns, end_ns)
        if threading.current_thread() is threading.main_thread():
            block = self.block_of(key) if key is not None else "<memory>"
            self.stall(block, start_ns, end_ns, "pool")

    def live(self, tier: str, nbytes: int, t_ns: int | None = None) -> None:
        """Tier `tier` now holds `nbytes` live bytes (kept even outside the window, written inside it)."""
        self._live[tier] = nbytes
        if self._active:
            self._put(("live", tier, nbytes, now_ns() if t_ns is None else t_ns))

    def held(self, tier: str, holder: str, nbytes: int, t_ns: int | None = None) -> None:
        """Of `tier`'s live bytes, `nbytes` are now held for `holder` (format.HOLDERS: "param", "staging", ...)."""
        if self._active:
            self._put(("held", tier, holder, nbytes, now_ns() if t_ns is None else t_ns))

    def peak(self, tier: str, nbytes: int, t_ns: int | None = None) -> None:
        """The store's high-water mark of `tier` over the current step (reset at its start) was `nbytes`."""
        if self._active:
            self._put(("peak", tier, nbytes, self._step, now_ns() if t_ns is None else t_ns))

    def _sample_rss(self, t_ns: int) -> None:
        if self.sample_rss:
            nbytes = rss_bytes()
            if nbytes is not None:
                self._put(("rss", nbytes, t_ns))

    def queue(self, stream: str, depth: int, t_ns: int | None = None) -> None:
        """Stream `stream` ("nvme-read", "nvme-write") now has `depth` requests in flight."""
        if self._active:
            self._put(("queue", stream, depth, now_ns() if t_ns is None else t_ns))

    # -- output --------------------------------------------------------------------------------

    def flush(self) -> None:
        """Encode and write the waiting records, then flush the file."""
        with self._lock:
            if self._closed:
                self._queue.clear()
                return
            queue, quoted = self._queue, self._quoted
            if len(quoted) > 100_000:  # unique keys must not grow it without bound
                quoted.clear()
            lines = []
            for _ in range(len(queue)):
                record = queue.popleft()
                try:
                    lines.append(encode_record(record, quoted))
                except (TypeError, ValueError) as exc:  # a bad argument must not stop training
                    self.bad_records += 1
                    if self.bad_records == 1:
                        warnings.warn(
                            f"profiler: dropped a {record[0]} record with a bad field ({exc}): {record}",
                            RuntimeWarning,
                            stacklevel=2,
                        )
            if lines:
                self._file.write("".join(lines))
                self._file.flush()

    def close(self) -> None:
        """Flush and close; later events are dropped. Idempotent; also runs at interpreter exit."""
        self._active = False
        self.flush()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._file.close()
        atexit.unregister(self.close)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _put(self, record: tuple) -> None:
        self._queue.append(record)  # deque.append is atomic: I/O threads record without a lock
        if len(self._queue) >= self.flush_every:
            self.flush()


def open_trace_writer(
    config: Any,
    rank: int,
    world_size: int,
    enabled: bool | None = None,
    raw_disk: dict[str, Any] | None = None,
    probe_disk: bool = True,
) -> TraceWriter | None:
    """A writer for `config.profiler` (an `InfinityConfig`), or None when profiling is off.

    `enabled` overrides `config.profiler.enabled` (the `--profile` flag passes True). The meta line gets
    the whole resolved config and, unless `raw_disk` is given, the speed of the NVMe swap directory as
    a short direct-I/O probe measures it now (`disk_probe.probe_swap_directory`; null without NVMe).
    """
    from infinity.profiler.format import settings_from_config

    prof = config.profiler
    if not (prof.enabled if enabled is None else enabled):
        return None
    if raw_disk is None and probe_disk:
        from infinity.profiler.disk_probe import probe_swap_directory

        raw_disk = probe_swap_directory(config, rank)
    to_dict = getattr(config, "to_dict", None)
    import torch

    return TraceWriter(
        prof.path,
        rank,
        world_size,
        settings_from_config(config),
        prof.start_step,
        prof.end_step,
        raw_disk=raw_disk,
        config=to_dict() if to_dict is not None else None,
        sample_rss=True,
        device="cuda" if torch.cuda.is_available() else "cpu",  # as the engine chooses
    )
