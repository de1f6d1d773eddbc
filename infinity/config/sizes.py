"""Sizes written in bytes ("64MB", "1GiB") for keys that count elements, converted once the dtype is known.

A key that allows it (`option(allow_bytes=True)`) keeps the validated string through parsing, as an
"auto" value is kept; `resolve_auto`, which runs after the compute dtype is final (the file's, or
`--dtype`'s), turns it into elements of that dtype: bytes // 4 for fp32, bytes // 2 for bf16 / fp16.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from infinity.config.errors import ConfigError

UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*$")


def parse_bytes(text: str, key: str) -> int:
    """The byte count `text` ("64MB", "1.5 GiB", case-insensitive) names; ConfigError naming `key` if none."""
    match = _SIZE.match(text)
    unit = match and UNITS.get(match.group(2).lower())
    if not unit:
        raise ConfigError(
            f"'{key}' is {text!r}; give a number of elements, or a size in bytes with a unit "
            '(B, KB, MB, GB, TB or KiB, MiB, GiB, TiB), e.g. "64MB"'
        )
    return int(float(match.group(1)) * unit)


def bytes_to_elems(text: str, key: str, dtype_name: str) -> int:
    """Elements of `dtype_name` ("float32", "bfloat16", "float16") that fit in the size `text`."""
    return parse_bytes(text, key) // ITEMSIZE[dtype_name]


def resolve_byte_sizes(section: Any, dtype_name: str, path: str) -> Any:
    """`section` (a config dataclass) with every byte-size string of an `allow_bytes` field in elements."""
    updates = {
        f.name: bytes_to_elems(getattr(section, f.name), f"{path}.{f.name}", dtype_name)
        for f in dataclasses.fields(section)
        if f.metadata.get("bytes") and isinstance(getattr(section, f.name), str)
    }
    return dataclasses.replace(section, **updates) if updates else section
