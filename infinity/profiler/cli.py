"""`infinity profile TRACE... [--out DIR] [--against TRACE...]` and `tools/swap_profile.py`: print the report,
write its files, and check its top prediction against a run with the change made."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from infinity.profiler.report import Report
    from infinity.profiler.traces import RankTrace


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "traces",
        nargs="+",
        metavar="TRACE",
        help="trace_rank*.jsonl files, or directories holding them (the profiler path)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="where trace.perfetto.json, summary.json and the PNGs go (default: <directory of the first trace>/report)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--top", type=int, default=5, help="how many slowest and most stalled blocks to list")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the traces have format problems")
    parser.add_argument(
        "--against",
        metavar="TRACE",
        nargs="+",
        help="traces of a run with the top recommendation's change made: print its predicted step against the "
        "measured one",
    )


def run_profile(args: argparse.Namespace) -> int:
    """Print the report of `args.traces`, write its files and check it `--against` a second run. The exit code:
    0; 1 with --strict where the traces have format problems; 2 for traces (given or --against) that cannot
    be read; 3 for a report folder that cannot be written (4: its disk is full). Each error is one line on
    stderr, and nothing is written before the traces of both runs are read."""
    from infinity.cli.faults import ExitCode
    from infinity.profiler.report import build_report
    from infinity.profiler.traces import load_traces

    given = args.out is not None
    out = args.out if given else _default_out(args.traces[0])
    if problem := _out_problem(out, given):
        return _fail(problem, ExitCode.PATH)
    against = None
    if args.against:
        try:
            against = load_traces(args.against)
        except (OSError, ValueError) as exc:
            return _fail(f"--against: {_read_error(exc)}", ExitCode.USAGE)
    try:
        report = build_report(args.traces, out, plots=not args.no_plots, top=args.top)
    except (OSError, ValueError) as exc:
        if isinstance(exc, OSError) and _inside(exc.filename, out):
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            where = f" ('{exc.filename}')" if os.path.abspath(exc.filename) != os.path.abspath(out) else ""
            return _fail(
                f"cannot write the report into {_out_name(out, given)}: {exc.strerror}{where}",
                ExitCode.DISK_FULL if full else ExitCode.PATH,
            )
        return _fail(_read_error(exc), ExitCode.USAGE)
    print(report.text)
    if against is not None:
        print()
        print(check_against(report, against))
    return 1 if args.strict and report.problems else 0


def _fail(message: str, code: int) -> int:
    print(f"infinity profile: {message}", file=sys.stderr)
    return int(code)


def _read_error(exc: OSError | ValueError) -> str:
    """A trace that cannot be read, in words: a ValueError's message names the file already."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"cannot read '{exc.filename}': {exc.strerror}"
    return str(exc)


def _default_out(first_trace: str) -> str:
    """`<directory of the first trace>/report`: the first trace itself where it is a directory."""
    return os.path.join(first_trace if os.path.isdir(first_trace) else os.path.dirname(first_trace) or ".", "report")


def _out_name(out: str, given: bool) -> str:
    return f"--out '{out}'" if given else f"'{out}' (the default beside the traces; choose another with --out DIR)"


def _inside(filename: str | bytes | None, folder: str) -> bool:
    if not isinstance(filename, str):
        return False
    path, folder = os.path.abspath(filename), os.path.abspath(folder)
    return path == folder or path.startswith(folder + os.sep)


def _out_problem(out: str, given: bool) -> str | None:
    """Why the report folder `out` cannot be created or written, found without creating anything; None if it can."""
    from pathlib import Path

    from infinity.cli.preflight import write_problem

    problem = write_problem(Path(out), folder=True)
    if not problem:
        return None
    name = _out_name(out, given)
    if problem == "is a file, not a folder":
        return f"{name} is a file, not a folder; give a folder for the report's files (made if missing)"
    return f"{name} {problem}; give --out a writable folder"


def check_against(report: Report, traces: list[RankTrace]) -> str:
    """The what-if check of `report`'s top finding against `traces` (a run with the change made, as
    `load_traces` returns them), in a line."""
    from infinity.profiler.report import prepare
    from infinity.profiler.whatif import check

    if not report.diagnosis.findings:
        return "what-if check: the report has no avoidable part, so no prediction to check"
    prepare(traces)
    return str(check(report.diagnosis.findings[0].prediction, traces))


def main(argv: list[str] | None = None) -> int:
    """Entry point: `infinity profile` (registered by the CLI) and `tools/swap_profile.py`."""
    parser = argparse.ArgumentParser(
        prog="infinity profile", description="Summarize and diagnose swap traces of all ranks."
    )
    add_profile_arguments(parser)
    return run_profile(parser.parse_args(argv))
