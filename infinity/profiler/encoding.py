"""How the trace writer encodes a record: each waits in memory as a tuple (type, *fields) and becomes one
JSON line at flush through its type's template (the fields of each type: `format`)."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Hashable

# Every line ends with its checksum: `{...,"crc32":N}` where N is the CRC-32 of the line's UTF-8 text before
# `,"crc32":` (format version 2). A reader checks it, so a byte changed on disk stops the report.
_SEAL = ',"crc32":%d}\n'
_SEALED = re.compile(r',"crc32":(\d{1,10})\}\s*$')

# Field marks: "$name" a string, JSON-quoted (a non-string is turned into one); "!name" JSON text
# already ("true"); "name" an integer.
_LAYOUTS: dict[str, tuple[str, tuple[bool, ...]]] = {}


def _layout(kind: str, *fields: str) -> None:
    body = ",".join(f'"{f.lstrip("$!")}":' + ("%d" if f[0] not in "$!" else "%s") for f in fields)
    _LAYOUTS[kind] = ('{"type":"' + kind + '",' + body, tuple(f.startswith("$") for f in fields))


_layout("step", "step", "start_ns", "end_ns")
_layout("phase", "step", "$phase", "start_ns", "end_ns")
_layout("move", "$key", "$block", "bytes", "$src", "$dst", "start_ns", "end_ns", "step", "$phase")
_layout("stall", "$block", "start_ns", "end_ns", "$waited_on", "step", "$phase")
_layout("collective", "$op", "$block", "bytes", "start_ns", "end_ns", "step", "$phase")
_layout("compute", "$block", "start_ns", "end_ns", "step", "$phase")
_layout("prefetch", "$block", "issued_ns", "step", "$phase")
_layout("use", "$block", "t_ns", "!ready", "step", "$phase")
_layout("pool", "$pool", "$event", "wait_ns", "t_ns", "step")
_layout("live", "$tier", "bytes", "t_ns")
_layout("queue", "$stream", "depth", "t_ns")
_layout("held", "$tier", "$holder", "bytes", "t_ns")
_layout("peak", "$tier", "bytes", "step", "t_ns")
_layout("rss", "bytes", "t_ns")


def encode_record(record: tuple, quoted: dict[Hashable, str]) -> str:
    """One JSON line for `record`; `quoted` caches the JSON text of string fields (keys repeat). Raises
    TypeError or ValueError for a field of the wrong kind."""
    template, flags = _LAYOUTS[record[0]]
    values = []
    for value, quote in zip(record[1:], flags, strict=True):
        if quote:
            text = quoted.get(value)
            if text is None:
                text = quoted[value] = json.dumps(value if isinstance(value, str) else str(value))
            value = text
        values.append(value)
    return seal(template % tuple(values))


def seal(body: str) -> str:
    """The trace line of a JSON object's text `body` without its closing brace: the body, its checksum, `}`."""
    return body + _SEAL % zlib.crc32(body.encode("utf-8"))


def seal_object(record: dict) -> str:
    """The sealed trace line of `record` (the meta line's way; records go through `encode_record`)."""
    return seal(json.dumps(record, separators=(",", ":"))[:-1])


def seal_state(line: str) -> bool | None:
    """True when `line` carries its checksum and it matches the text, False when it carries one that does not,
    None when it carries none (a version 1 line, or a line cut before its end)."""
    found = _SEALED.search(line)
    if found is None:
        return None
    return int(found.group(1)) == zlib.crc32(line[: found.start()].encode("utf-8"))
