"""Swap profiling: a trace writer cheap enough to leave on, and a report that says what to tune.

Recording: `TraceWriter` (or `open_trace_writer(config, rank, world_size)`, None when disabled).
The trace format is specified in `infinity.profiler.format` and FORMAT.md. Reporting:
`infinity.profiler.report.build_report`, `tools/swap_profile.py`, `infinity profile`.
"""

from infinity.profiler.format import VERSION, settings_from_config, trace_filename
from infinity.profiler.writer import TraceWriter, open_trace_writer

__all__ = ["VERSION", "TraceWriter", "open_trace_writer", "settings_from_config", "trace_filename"]
