"""`infinity profile TRACE... [--out DIR] [--against TRACE...]` and `tools/swap_profile.py`: print the report,
write its files, and check its top prediction against a run with the change made."""

from __future__ import annotations

import argparse
import sys


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
    import os

    from infinity.profiler.report import build_report

    out = args.out
    if out is None:
        first = args.traces[0]
        out = os.path.join(first if os.path.isdir(first) else os.path.dirname(first) or ".", "report")
    try:
        report = build_report(args.traces, out, plots=not args.no_plots, top=args.top)
    except (OSError, ValueError) as exc:
        print(f"infinity profile: {exc}", file=sys.stderr)
        return 2
    print(report.text)
    if args.against:
        print()
        print(check_against(report, args.against))
    return 1 if args.strict and report.problems else 0


def check_against(report, paths: list[str]) -> str:
    """The what-if check of `report`'s top finding against the traces in `paths`, in a line."""
    from infinity.profiler.report import prepare
    from infinity.profiler.traces import load_traces
    from infinity.profiler.whatif import check

    if not report.diagnosis.findings:
        return "what-if check: the report has no avoidable part, so no prediction to check"
    traces = load_traces(paths)
    prepare(traces)
    return str(check(report.diagnosis.findings[0].prediction, traces))


def main(argv: list[str] | None = None) -> int:
    """Entry point: `infinity profile` (registered by the CLI) and `tools/swap_profile.py`."""
    parser = argparse.ArgumentParser(
        prog="infinity profile", description="Summarize and diagnose swap traces of all ranks."
    )
    add_profile_arguments(parser)
    return run_profile(parser.parse_args(argv))
