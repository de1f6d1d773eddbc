"""How the trace writer encodes a record: each waits in memory as a tuple (type, *fields) and becomes one
JSON line at flush through its type's template (the fields of each type: `format`)."""

from __future__ import annotations

import json
from collections.abc import Hashable

# Field marks: "$name" a string, JSON-quoted (a non-string is turned into one); "!name" JSON text
# already ("true"); "name" an integer.
_LAYOUTS: dict[str, tuple[str, tuple[bool, ...]]] = {}


def _layout(kind: str, *fields: str) -> None:
    body = ",".join(f'"{f.lstrip("$!")}":' + ("%d" if f[0] not in "$!" else "%s") for f in fields)
    _LAYOUTS[kind] = ('{"type":"' + kind + '",' + body + "}\n", tuple(f.startswith("$") for f in fields))


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
    return template % tuple(values)
