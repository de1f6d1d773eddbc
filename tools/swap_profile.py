"""Summarize and diagnose infinity swap traces: `python tools/swap_profile.py TRACE... [--out DIR]`.

TRACE is a trace_rank*.jsonl file or the profiler path holding them. Prints the summary per step and
phase and the diagnosis; writes trace.perfetto.json (ui.perfetto.dev), summary.json and PNG plots into DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a checkout without installing

from infinity.profiler.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
