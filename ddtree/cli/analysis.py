"""`ddtree analyze` and `ddtree advise`: the CLI over `telemetry`'s log analysis (argument glue only)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ddtree.cli.common import add_command, deprecated
from ddtree.errors import UserError

if TYPE_CHECKING:
    from telemetry.analysis.cost import CostFile
    from telemetry.analysis.digest import Digest
    from telemetry.analysis.schedule import Plan

# Names shared with the other subcommands: `--out` is where a command writes (here the report's directory),
# `--json` prints JSON on stdout, and `--cost-curve FILE` is the file `ddtree bench --cost-curve` writes
# (`--cost`, its old name here, is kept as an alias for a release).
LOG_HELP = "a JSON log written with DDTREE_DEBUG_METRICS=1 (- : stdin)"


def add_parsers(sub: Any) -> None:
    analyze = add_command(
        sub,
        "analyze",
        "step logs -> tables, summary.json, plots, report.html, trace events",
        (
            "DDTREE_DEBUG_METRICS=1 DDTREE_LOG_FILE=run.jsonl OTEL_TRACES_EXPORTER=none \\",
            "    OTEL_METRICS_EXPORTER=none ddtree generate --budget 64 --prompt 'Explain recursion.'",
            "ddtree analyze run.jsonl --out report/ --trace-events trace.json",
        ),
    )
    analyze.add_argument("log", nargs="?", default="-", help=LOG_HELP)
    analyze.add_argument("--out", metavar="DIR", help="write summary.json, PNG plots and report.html to this directory")
    analyze.add_argument(
        "--trace-events", metavar="FILE", help="write Chrome trace-event JSON (Perfetto, chrome://tracing) here"
    )
    analyze.set_defaults(func=_analyze)

    advise = add_command(
        sub,
        "advise",
        "the budget and top-k with the best predicted tokens/s, from one logged run",
        (
            "ddtree advise run.jsonl",
            "ddtree bench --methods ddtree --budgets 1,4,16,64 --num-prompts 4 --cost-curve cost.json",
            "ddtree advise run.jsonl --cost-curve cost.json --json",
            "ddtree bench --methods ar,ddtree --budgets 4,16,64 --batch-sizes 1,4,16,64 --cost-curve cost.json",
            "ddtree advise run.jsonl --cost-curve cost.json --schedule schedule.json",
        ),
    )
    advise.add_argument("log", nargs="?", default="-", help=LOG_HELP)
    advise.add_argument(
        "--cost-curve",
        "--cost",
        dest="cost",
        metavar="FILE",
        help="ms per step by budget, from `ddtree bench --cost-curve FILE` (default: the log's own)"
        + deprecated("--cost"),
    )
    advise.add_argument(
        "--schedule",
        metavar="OUT",
        help="also plan a budget schedule (a choice per batch size of --cost-curve, which it needs) and write it"
        " here, for `serve --budget-schedule OUT`",
    )
    advise.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    advise.set_defaults(func=_advise)


@contextlib.contextmanager
def _lines(path: str) -> Iterator[IO[str]]:
    if path == "-":
        yield sys.stdin
        return
    try:
        stream = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise UserError(f"cannot read {path!r}: {exc.strerror}") from exc
    with stream:
        yield stream


def _digest(path: str, trace_out: IO[str] | None = None, each: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """The log's digest; `each` (or the trace-event writer) sees every record too."""
    from telemetry.analysis.digest import Digest
    from telemetry.analysis.trace_events import TraceEventWriter

    writer = TraceEventWriter(trace_out) if trace_out is not None else None
    with _lines(path) as stream:
        try:
            digest = Digest.of(stream, writer.add if writer is not None else each)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path!r} has ddtree lines without the expected fields: {exc!r}") from exc
    if writer is not None:
        writer.close()
    if not digest.counts.steps:
        raise UserError(f"{path!r} has no ddtree.step lines ({digest.counts.bad} bad lines of {digest.counts.lines})")
    return digest


def _analyze(args: argparse.Namespace) -> int:
    from telemetry.analysis.steps import advice, format_table

    if args.trace_events:
        try:
            trace_out: IO[str] | None = open(args.trace_events, "w", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            raise UserError(f"cannot write --trace-events {args.trace_events!r}: {exc.strerror}") from exc
    else:
        trace_out = None
    try:
        digest = _digest(args.log, trace_out)
    finally:
        if trace_out is not None:
            trace_out.close()
    groups = digest.sorted_configs()
    table = format_table(groups)
    print(table)
    print(advice(groups))
    print(f"completeness: {digest.completeness().line()}")
    counts = digest.counts
    print(f"{counts.lines} lines: {counts.steps} steps, {counts.requests} requests, {counts.bad} bad lines")
    if args.out:
        from telemetry.analysis.report import write_report

        try:
            files = write_report(digest, Path(args.out), table)
        except OSError as exc:
            raise UserError(f"cannot write the report to {args.out!r}: {exc.strerror}") from exc
        print(f"wrote {len(files)} files to {args.out}: " + ", ".join(f.name for f in files))
    return 0


def _advise(args: argparse.Namespace) -> int:
    from telemetry.analysis.advise import advise, format_advice
    from telemetry.analysis.cost import read_costs

    if args.schedule and not args.cost:
        raise UserError("--schedule needs --cost-curve FILE: the step times of each budget at each batch size")
    try:
        cost = read_costs(Path(args.cost)) if args.cost else None
    except OSError as exc:
        raise UserError(f"cannot read --cost-curve {args.cost!r}: {exc.strerror}") from exc
    except ValueError as exc:
        raise UserError(f"--cost-curve: {exc}") from exc
    from telemetry.analysis.adaptive import AdaptiveLog

    adaptive = AdaptiveLog() if cost is not None else None
    digest = _digest(args.log, each=adaptive)
    try:
        result = advise(digest, cost, adaptive)
    except ValueError as exc:  # IncompleteLog among them: too few of the run's steps were logged
        raise UserError(str(exc)) from exc
    plan = _plan(cost, digest) if args.schedule and cost is not None else None
    if args.json:
        print(json.dumps(result if plan is None else {**result, "schedule": plan.to_dict()}))
    else:
        print(format_advice(result))
    if plan is not None:
        _write_plan(args, plan)
    return 0


def _plan(cost: CostFile, digest: Digest) -> Plan:
    from telemetry.analysis.schedule import plan_schedule

    try:
        return plan_schedule(cost, digest)
    except ValueError as exc:
        raise UserError(f"--schedule: {exc}") from exc


def _write_plan(args: argparse.Namespace, plan: Plan) -> None:
    from ddtree.schedule import write_schedule

    try:
        write_schedule(Path(args.schedule), plan.schedule)
    except OSError as exc:
        raise UserError(f"cannot write --schedule {args.schedule!r}: {exc.strerror}") from exc
    if not args.json:
        print(plan.table())
        print(f"wrote the schedule to {args.schedule}")
