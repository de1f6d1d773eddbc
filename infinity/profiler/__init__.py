"""Swap profiling: a trace writer cheap enough to leave on, and a report that says what to change.

Recording: `TraceWriter` (or `open_trace_writer(config, rank, world_size)`, None when disabled), which
probes the swap directory's disk (`disk_probe`) and records the run's config in the meta line. The
trace format is specified in `infinity.profiler.format` and FORMAT.md, with what the engine emits.
Reading: `breakdown` (each phase's compute, stalls, serial I/O), `verdict` (the step's bound and its
avoidable parts), `whatif` (the step a change would give, and its check), `diagnosis` (the verdict
and the settings to change, only keys that change something: `knob_effects`), `accounting` (live
bytes against the store's high-water marks), `report.build_report`, `infinity profile`.
"""

from infinity.profiler.format import VERSION, settings_from_config, trace_filename
from infinity.profiler.writer import TraceWriter, open_trace_writer

__all__ = ["VERSION", "TraceWriter", "open_trace_writer", "settings_from_config", "trace_filename"]
