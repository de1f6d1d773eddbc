"""Editing a written trace as a buggy writer would have written it: edited lines get fresh checksums, so the
reader's checks on the records (not the checksum's) are what a test sees."""

from __future__ import annotations

import re

from infinity.profiler.encoding import seal

_CHECKSUM = re.compile(r',"crc32":\d+\}$')


def reseal(text: str) -> str:
    """`text` (trace lines) with every non-blank line's checksum computed anew, the line's own dropped."""
    lines = []
    for line in text.splitlines():
        if line.strip():
            body, sealed = _CHECKSUM.subn("", line)
            line = seal(body if sealed else body[: body.rindex("}")]).rstrip("\n")
        lines.append(line)
    return "\n".join(lines) + "\n"
