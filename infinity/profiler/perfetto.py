"""Chrome trace-event JSON of swap traces, for ui.perfetto.dev (or chrome://tracing).

One process per rank (pid = rank); one thread track each for steps, phases (each slice's args carry
its breakdown: compute, stall, serial I/O and other ms), compute, stalls (named by what they waited
on), serial I/O (the times I/O ran and nothing else did), collectives, every tier pair, buffer pools
and prefetch/use marks; counter tracks for NVMe read and write GB/s, live bytes per tier and per
holder, the store's peaks, the process's RSS and NVMe queue depths. Spans that overlap on one track
(several moves in flight) are spread over extra lanes ("nvme->host #2", ...) because a track's slices
must nest. Times are microseconds on the shared timeline of `traces.load_traces`.
"""

from __future__ import annotations

import functools
import heapq
import json
import os
from typing import Any

from infinity.profiler.breakdown import rank_steps, serial_io_spans
from infinity.profiler.format import tier_pair, wait_group
from infinity.profiler.plots import bandwidth_bins, origin_ns
from infinity.profiler.traces import RankTrace, Record

Event = dict[str, Any]


def _lanes(spans: list[tuple[int, int]]) -> list[int]:
    """A lane per span (in input order): spans in one lane never overlap; each takes the lowest free lane."""
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    busy: list[tuple[int, int]] = []  # (end of the lane's last span, lane)
    free: list[int] = []
    lanes, count = [0] * len(spans), 0
    for i in order:
        start, end = spans[i]
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane, count = count, count + 1
        lanes[i] = lane
        heapq.heappush(busy, (end, lane))
    return lanes


class _Tracks:
    """Thread ids of one rank's named tracks, with their metadata events."""

    def __init__(self, pid: int, events: list[Event]) -> None:
        self.pid, self.events, self.ids = pid, events, {}

    def tid(self, name: str, lane: int = 0) -> int:
        label = name if lane == 0 else f"{name} #{lane + 1}"
        if label not in self.ids:
            tid = self.ids[label] = len(self.ids) + 1
            self.events.append({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid, "args": {"name": label}})
            self.events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": self.pid, "tid": tid, "args": {"sort_index": tid}}
            )
        return self.ids[label]


def _spans(trace: RankTrace, tracks: _Tracks, track: str, records: list[Record], name_of, args_of) -> None:
    lanes = _lanes([(r["start_ns"], r["end_ns"]) for r in records])
    for r, lane in zip(records, lanes, strict=True):
        start = trace.to_global(r["start_ns"])
        tracks.events.append(
            {
                "ph": "X",
                "name": name_of(r),
                "cat": r["type"],
                "pid": tracks.pid,
                "tid": tracks.tid(track, lane),
                "ts": start / 1000,
                "dur": (r["end_ns"] - r["start_ns"]) / 1000,
                "args": args_of(r),
            }
        )


def _when(r: Record) -> dict[str, Any]:
    return {"step": r["step"], "phase": r["phase"]}


def _gbps(r: Record) -> float:
    return round(r["bytes"] / (r["end_ns"] - r["start_ns"]), 3) if r["end_ns"] > r["start_ns"] else 0.0


def _phase_args(parts: dict, r: Record) -> dict[str, Any]:
    """A phase slice's args: its step and phase, and its breakdown (of all its spans) in ms."""
    p = parts.get((r["step"], r["phase"]))
    if p is None:
        return _when(r)
    ms = {"compute": p.compute_ns, "stall": p.stall_total_ns, "serial I/O": p.serial_io_ns, "other": p.other_ns}
    return {**_when(r), **{f"{k} ms (whole phase)": round(v / 1e6, 3) for k, v in ms.items()}}


def _bandwidth_counters(trace: RankTrace, pid: int, bins: int = 400) -> list[Event]:
    """NVMe read and write GB/s of one rank, in time bins (counter tracks)."""
    width_s, series = bandwidth_bins([trace], bins)
    origin = origin_ns([trace])
    out = []
    for name, pairs in (
        ("NVMe read GB/s", ("nvme->host", "nvme->device")),
        ("NVMe write GB/s", ("host->nvme", "device->nvme")),
    ):
        rows = [series[p] for p in pairs if p in series]
        if not rows:
            continue
        for i in range(bins):
            ts = (origin + i * width_s * 1e9) / 1000
            out.append(
                {"ph": "C", "name": name, "pid": pid, "ts": ts, "args": {"GB/s": round(sum(r[i] for r in rows), 3)}}
            )
    return out


def chrome_trace(traces: list[RankTrace]) -> dict[str, Any]:
    """The trace-event JSON object of all ranks."""
    events: list[Event] = []
    for trace in traces:
        pid = trace.rank
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {pid}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        tracks = _Tracks(pid, events)
        _spans(trace, tracks, "steps", trace.of("step"), lambda r: f"step {r['step']}", lambda r: {"step": r["step"]})
        parts = {(s.step, name): p for s in rank_steps(trace) for name, p in s.phases.items()}
        _spans(trace, tracks, "phases", trace.of("phase"), lambda r: r["phase"], functools.partial(_phase_args, parts))
        _spans(trace, tracks, "compute", trace.of("compute"), lambda r: r["block"], _when)
        _spans(
            trace,
            tracks,
            "stalls",
            trace.of("stall"),
            lambda r: f"stall on {wait_group(r['waited_on'])}: {r['block']}",
            lambda r: {**_when(r), "waited_on": r["waited_on"]},
        )
        serial = [{"type": "serial", "start_ns": s, "end_ns": e} for s, e in serial_io_spans(trace)]
        _spans(trace, tracks, "serial I/O", serial, lambda r: "serial I/O", lambda r: {})
        _spans(
            trace,
            tracks,
            "collectives",
            trace.of("collective"),
            lambda r: f"{r['op']} {r['block']}",
            lambda r: {**_when(r), "bytes": r["bytes"], "GB/s": _gbps(r)},
        )
        by_pair: dict[str, list[Record]] = {}
        for r in trace.of("move"):
            by_pair.setdefault(tier_pair(r["src"], r["dst"]), []).append(r)
        for pair, moves in by_pair.items():
            _spans(
                trace,
                tracks,
                pair,
                moves,
                lambda r: r["block"],
                lambda r: {**_when(r), "key": r["key"], "bytes": r["bytes"], "GB/s": _gbps(r)},
            )
        for r in trace.of("pool"):
            events.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": f"{r['pool']} pool exhausted",
                    "pid": pid,
                    "tid": tracks.tid("pools"),
                    "ts": trace.to_global(r["t_ns"]) / 1000,
                    "args": {"wait_ms": r["wait_ns"] / 1e6, "step": r["step"]},
                }
            )
        marks = [(r["issued_ns"], f"prefetch {r['block']}") for r in trace.of("prefetch")]
        marks += [(r["t_ns"], f"{'hit' if r['ready'] else 'miss'} {r['block']}") for r in trace.of("use")]
        for t, name in marks:
            events.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": name,
                    "pid": pid,
                    "tid": tracks.tid("prefetch/use"),
                    "ts": trace.to_global(t) / 1000,
                }
            )
        counters = [(r["t_ns"], f"live {r['tier']} bytes", r["bytes"]) for r in trace.of("live")]
        counters += [(r["t_ns"], f"held {r['tier']} {r['holder']} bytes", r["bytes"]) for r in trace.of("held")]
        counters += [(r["t_ns"], f"store peak {r['tier']} bytes", r["bytes"]) for r in trace.of("peak")]
        counters += [(r["t_ns"], "process RSS bytes", r["bytes"]) for r in trace.of("rss")]
        for t, name, value in counters:
            events.append(
                {"ph": "C", "name": name, "pid": pid, "ts": trace.to_global(t) / 1000, "args": {"bytes": value}}
            )
        events += _bandwidth_counters(trace, pid)
        for r in trace.of("queue"):
            events.append(
                {
                    "ph": "C",
                    "name": f"{r['stream']} queue depth",
                    "pid": pid,
                    "ts": trace.to_global(r["t_ns"]) / 1000,
                    "args": {"depth": r["depth"]},
                }
            )
    origin = min((e["ts"] for e in events if "ts" in e), default=0)
    for e in events:  # the earliest event at 0: traces written with arbitrary clocks stay non-negative
        if "ts" in e:
            e["ts"] -= origin
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": "infinity swap profiler", "ranks": [t.rank for t in traces]},
    }


def write_perfetto(traces: list[RankTrace], path: str | os.PathLike) -> str:
    """Write `chrome_trace(traces)` to `path`; returns the path."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(traces), f, separators=(",", ":"))
    return os.fspath(path)
