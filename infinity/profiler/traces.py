"""Reading swap traces: one `RankTrace` per rank file, a cut last line (a crashed run) tolerated.

`load_traces` takes files or directories (all `trace_rank*.jsonl` inside) and puts every rank on one
timeline: `RankTrace.to_global(t_ns)` is nanoseconds since the earliest rank opened its trace,
aligned through each meta line's wall-clock `t0_unix_ns` (exact on one node, clock-skewed across nodes).
"""

from __future__ import annotations

import glob
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from infinity.profiler.encoding import seal_state
from infinity.profiler.format import meta_problem, tier_pair

Record = dict[str, Any]


@dataclass
class RankTrace:
    """One rank's records by type, in file order; `truncated` when its last line was cut off."""

    path: str
    meta: Record
    records: dict[str, list[Record]] = field(default_factory=lambda: defaultdict(list))
    truncated: bool = False
    offset_ns: int = 0  # added to this file's times to put them on the shared timeline

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])

    @property
    def settings(self) -> dict[str, Any]:
        return self.meta.get("settings") or {}

    def of(self, kind: str) -> list[Record]:
        """The records of type `kind` ([] when there are none)."""
        return self.records.get(kind, [])

    def to_global(self, t_ns: int) -> int:
        return t_ns + self.offset_ns

    def steps(self) -> dict[int, tuple[int, int, bool]]:
        """step -> (start_ns, end_ns, complete); a step cut by a crash spans its phase records and events."""
        spans = {r["step"]: (r["start_ns"], r["end_ns"], True) for r in self.of("step")}
        seen: dict[int, list[int]] = defaultdict(list)
        for kind in ("phase", "move", "stall", "collective", "compute"):
            for r in self.of(kind):
                if r["step"] not in spans:
                    seen[r["step"]] += (r["start_ns"], r["end_ns"])
        for kind, t in (("use", "t_ns"), ("prefetch", "issued_ns"), ("pool", "t_ns")):
            for r in self.of(kind):
                if r["step"] not in spans:
                    seen[r["step"]].append(r[t])
        for step, times in seen.items():
            spans[step] = (min(times), max(times), False)
        return dict(sorted(spans.items()))

    def phase_spans(self) -> dict[tuple[int, str], list[tuple[int, int]]]:
        """(step, phase) -> its spans; phases without phase records span their own events."""
        spans: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
        for r in self.of("phase"):
            spans[(r["step"], r["phase"])].append((r["start_ns"], r["end_ns"]))
        extent: dict[tuple[int, str], list[int]] = {}
        for kind in ("move", "stall", "collective", "compute"):
            for r in self.of(kind):
                key = (r["step"], r["phase"])
                if key not in spans:
                    lo_hi = extent.setdefault(key, [r["start_ns"], r["end_ns"]])
                    lo_hi[0], lo_hi[1] = min(lo_hi[0], r["start_ns"]), max(lo_hi[1], r["end_ns"])
        for key, (lo, hi) in extent.items():
            spans[key].append((lo, hi))
        return dict(spans)

    def live_series(self) -> dict[str, list[tuple[int, int]]]:
        """tier -> [(t_ns, live bytes)] in time order."""
        series: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for r in self.of("live"):
            series[r["tier"]].append((r["t_ns"], r["bytes"]))
        return {tier: sorted(points, key=lambda p: p[0]) for tier, points in series.items()}  # ties: file order

    def pairs(self) -> list[str]:
        """The tier pairs this rank moved bytes between, in first-seen order."""
        return list(dict.fromkeys(tier_pair(r["src"], r["dst"]) for r in self.of("move")))


@dataclass(frozen=True)
class _NotUtf8:
    """A line that is not UTF-8: its first bad byte and that byte's offset in the file."""

    offset: int
    byte: int
    cut: bool  # the line ends inside a character, as a writer that died mid-line leaves it


def _text_lines(path: str) -> list[tuple[int, str | _NotUtf8]]:
    """(line number, text) of the file's non-blank lines, a line that is not UTF-8 as _NotUtf8."""
    lines: list[tuple[int, str | _NotUtf8]] = []
    offset = 0
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                cut = exc.reason == "unexpected end of data"
                lines.append((n, _NotUtf8(offset + exc.start, raw[exc.start], cut)))
            else:
                if text.strip():
                    lines.append((n, text))
            offset += len(raw)
    return lines


def _damaged(path: str, n: int, why: str) -> ValueError:
    return ValueError(
        f"{path}:{n}: {why}: the file changed after the profiler wrote it (a damaged disk or an edit); "
        "record the trace again"
    )


def load_trace(path: str | os.PathLike) -> RankTrace:
    """Read one rank's file; raises ValueError naming the file and line for a bad line other than a cut last
    one (not JSON, not UTF-8, not a record, a checksum that does not match its text, or no checksum where the
    meta line has one) and for a meta line the reader cannot use. Version 1 traces carry no checksums."""
    path = os.fspath(path)
    lines = _text_lines(path)
    trace: RankTrace | None = None
    truncated = False
    sealed = False  # the meta line carried a checksum, so every line must
    for i, (n, line) in enumerate(lines):
        last = i == len(lines) - 1
        if isinstance(line, _NotUtf8):
            if last and line.cut:  # the writer died inside a character
                truncated = True
                break
            raise ValueError(
                f"{path}:{n}: byte 0x{line.byte:02x} at offset {line.offset} is not UTF-8; a trace is UTF-8 JSON "
                "lines written by the infinity profiler"
            )
        state = seal_state(line)
        if state is False:
            raise _damaged(path, n, "the line's checksum does not match its text")
        if state is None and sealed:
            if last:  # the writer died mid-line
                truncated = True
                break
            raise _damaged(path, n, "the line has lost its checksum")
        sealed = sealed or (trace is None and state is True)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if last:  # the writer died mid-line
                truncated = True
                break
            raise ValueError(f"{path}:{n}: not a JSON line ({exc}); only the last line of a trace may be cut") from exc
        if not isinstance(record, dict) or "type" not in record:
            raise ValueError(f"{path}:{n}: a record must be a JSON object with a 'type'")
        record.pop("crc32", None)
        if trace is None:
            if not sealed and isinstance(record.get("version"), int) and record["version"] >= 2:
                raise _damaged(path, n, f"a version {record['version']} meta line without its checksum")
            if record["type"] != "meta":
                raise ValueError(f"{path}:{n}: the first record must be 'meta', got {record['type']!r}")
            if problem := meta_problem(record):
                raise ValueError(f"{path}:{n}: {problem}; is this a trace written by the infinity profiler?")
            trace = RankTrace(path, record)
        else:
            trace.records[record["type"]].append(record)
    if trace is None:
        raise ValueError(f"{path}: no meta line; is this a trace_rank*.jsonl file from the infinity profiler?")
    trace.truncated = truncated
    return trace


def expand_paths(paths: list[str | os.PathLike]) -> list[str]:
    """Files as given; directories replaced by the `trace_rank*.jsonl` files inside them."""
    files: list[str] = []
    for p in paths:
        p = os.fspath(p)
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "trace_rank*.jsonl")))
            if not found:
                raise ValueError(f"{p}: no trace_rank*.jsonl files in this directory")
            files += found
        elif os.path.exists(p):
            files.append(p)
        else:
            raise ValueError(f"{p}: no such trace file or directory")
    return files


def load_traces(paths: list[str | os.PathLike]) -> list[RankTrace]:
    """Load the ranks' traces, sorted by rank, on one timeline; two files of one rank are an error."""
    traces = sorted((load_trace(p) for p in expand_paths(paths)), key=lambda t: t.rank)
    ranks = [t.rank for t in traces]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"several traces of one rank among {[t.path for t in traces]}; give one run's files")
    if traces:
        unix = [t.meta.get("t0_unix_ns") for t in traces]
        base = min(u for u in unix if u is not None) if any(u is not None for u in unix) else 0
        for t, u in zip(traces, unix, strict=True):
            t.offset_ns = (0 if u is None else u - base) - int(t.meta["t0_ns"])
    return traces
