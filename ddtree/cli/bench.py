"""`ddtree bench`: tau and speed of ar, dflash and ddtree on one prompt set (argument glue over `ddtree.bench`).

The header line (what runs where) is printed before the rows run, and on a terminal a progress bar on stderr
counts the rows' batch runs, warm-ups included; off a terminal (a log file, a pipe) stderr gets a line at most
every `PROGRESS_LINE_S` seconds, and one at the end, so that a long run never looks stuck.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree.adaptive import DEFAULT_MAX_BUDGET
from ddtree.cli.common import (
    POSITIVE,
    SEED,
    add_command,
    budget_list,
    deprecated,
    device_args,
    engine_options,
    float_flag,
    model_args,
    prompt_set,
    prompt_set_args,
)
from ddtree.errors import UserError
from ddtree.methods import METHOD_NAMES

if TYPE_CHECKING:
    from ddtree.bench.rows import Sampling
    from ddtree.schedule import BudgetSchedule

PROGRESS_LINE_S = 30.0  # off a terminal: the most seconds between two progress lines

# Names shared with the other subcommands (old spellings kept as aliases for a release):
# - `--num-prompts N` as in `drafter data` (and vLLM's and SGLang's benchmarks); `--limit` is its old name.
# - `--out FILE` writes the rows as JSON, as `--out` names what every command writes; `--json` is a flag
#   elsewhere (print JSON on stdout), so `--json FILE` here is the old, deprecated spelling.
# - `--cost-curve FILE`: the file this writes and `ddtree advise --cost-curve` reads.
EXAMPLES = (
    "ddtree bench --num-prompts 8 --max-new-tokens 64 --budgets 16,32",
    "ddtree bench --model TARGET --drafter DRAFTER --batch-size 16 --continuous --out rows.json",
    "ddtree bench --methods ddtree --budgets 1,4,16,64 --num-prompts 4 --cost-curve cost.json",
    "ddtree bench --methods ar,ddtree --batch-sizes 1,4,16,64 --num-prompts 64 --cost-curve c.json",
    "ddtree bench --methods ar,ddtree --temperature 0.7 --seed 1 --budget-schedule schedule.json",
)


def add_parser(sub: Any) -> None:
    bench = add_command(sub, "bench", "tau and speed of ar, dflash and ddtree on a prompt set, in one run", EXAMPLES)
    model_args(bench)
    prompt_set_args(bench, aliases=("--limit",))
    bench.add_argument(
        "--methods", default="ar,dflash,ddtree", help=f"comma-separated methods to run, of {', '.join(METHOD_NAMES)}"
    )
    bench.add_argument(
        "--budgets",
        type=budget_list,
        default="4,8,16,32,64",
        help="comma-separated tree budgets: one row per budget for methods tuned by it (ddtree)",
    )
    bench.add_argument(
        "--budget-schedule",
        metavar="FILE",
        help="also a row `auto`: ddtree with each step's tree taken from this budget schedule (as `ddtree advise"
        " --schedule` writes it) by the rows the step runs; it runs even where --methods leaves out ddtree",
    )
    bench.add_argument(
        "--adaptive",
        action="store_true",
        help="also a row `adaptive`: ddtree with each step's width chosen by the step's own tree (as `--budget"
        " adaptive` decodes), up to --max-budget; it runs even where --methods leaves out ddtree",
    )
    bench.add_argument(
        "--max-budget",
        type=POSITIVE,
        default=DEFAULT_MAX_BUDGET,
        help="the widest tree the adaptive row's steps may verify",
    )
    bench.add_argument("--max-new-tokens", type=POSITIVE, default=128, help="new tokens per prompt, at most")
    bench.add_argument(
        "--temperature",
        type=float_flag(0),
        default=0.0,
        help="every row's sampling temperature (0: greedy); above 0, --baseline hf is refused (HF generate"
        " cannot sample with our per-request seeds)",
    )
    bench.add_argument(
        "--seed", type=SEED, default=0, help="prompt i of the set samples with seed + i, in every row and batch"
    )
    bench.add_argument("--batch-size", type=POSITIVE, default=1, help="prompts decoded together")
    bench.add_argument(
        "--batch-sizes",
        type=budget_list,
        metavar="LIST",
        help="instead of --batch-size: one table per batch size, in one run (e.g. 1,4,16,64); with --cost-curve,"
        " one curve per batch size",
    )
    bench.add_argument(
        "--continuous",
        action="store_true",
        help="our rows stream the prompts through --batch-size slots (continuous batching, as the server runs)",
    )
    bench.add_argument(
        "--baseline", choices=("hf",), action="append", default=[], help="add HF transformers generate's row"
    )
    bench.add_argument(
        "--rounds",
        type=POSITIVE,
        default=None,
        help="timed rounds of the interleaved rows (default 1), or off/on rounds for --telemetry-overhead (default 4)",
    )
    device_args(bench, graphs=True)
    bench.add_argument(
        "--out",
        "--json",
        dest="json_out",
        metavar="FILE",
        help="also write the rows to this JSON file" + deprecated("--json"),
    )
    bench.add_argument(
        "--cost-curve",
        metavar="FILE",
        help="also write ar's and ddtree's ms per step by budget here, per batch size, with each budget's tau and"
        " the temperature (for `ddtree advise`; the auto row is no point of it)",
    )
    bench.add_argument(
        "--telemetry-overhead",
        action="store_true",
        help="instead: tokens/s of the first method and budget with telemetry off and on, interleaved",
    )
    bench.add_argument("--tree-build", action="store_true", help="instead: time the tree build alone (torch, triton)")
    bench.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from ddtree.models.chat import chat_ids, eos_ids
    from ddtree.runtime import resolve_paths

    if args.tree_build:
        return _tree_build_bench(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHOD_NAMES]
    if bad or not methods:
        raise UserError(f"--methods takes {', '.join(METHOD_NAMES)}, got {args.methods!r}")
    sampling, schedule = _sampling(args), _schedule(args)
    options = engine_options(args)
    options.check()
    prompts = prompt_set(args)
    if args.batch_sizes and not args.continuous and max(args.batch_sizes) > len(prompts):
        # a static batch larger than the prompts would time fewer rows than its curve says
        raise UserError(
            f"--batch-sizes {max(args.batch_sizes)} needs at least as many prompts; there are {len(prompts)}"
        )
    drafting = methods != ["ar"] or schedule is not None or args.adaptive
    model, drafter_dir = resolve_paths(args.model, args.drafter, "ddtree" if drafting else "ar")
    target, drafter, tokenizer = options.load_models(model, drafter_dir)
    if tokenizer is None:
        raise UserError("bench needs a model with a tokenizer")
    if args.telemetry_overhead:
        return _overhead(args, (model, drafter_dir), target, tokenizer, prompts, methods[0], sampling)
    eos = eos_ids(tokenizer, target)
    encoded = [chat_ids(tokenizer, p) for p in prompts]
    engine = options.engine(target, drafter)
    sizes = args.batch_sizes or [args.batch_size]
    measured: list[Any] = []
    for batch_size in sizes:
        rows = _bench_at(args, engine, encoded, eos, methods, batch_size, sampling, schedule)
        measured += [(batch_size, row) for row in rows]
    _write_outputs(args, measured, sampling)
    return 0


def _sampling(args: argparse.Namespace) -> Sampling:
    """`--temperature` and `--seed`; UserError for a temperature HF generate's row cannot sample at."""
    from ddtree.bench.rows import Sampling

    if args.baseline and args.temperature > 0:
        raise UserError(
            f"--baseline hf decodes greedily only (HF generate cannot sample with our per-request seeds);"
            f" leave it out or use --temperature 0, got {args.temperature}"
        )
    return Sampling(args.temperature, args.seed)


def _schedule(args: argparse.Namespace) -> BudgetSchedule | None:
    """The `--budget-schedule` file, or None; UserError, in one line, where it does not parse."""
    from ddtree.schedule import read_schedule

    if args.budget_schedule is None:
        return None
    if args.telemetry_overhead:
        raise UserError("--budget-schedule adds a row to the table; --telemetry-overhead runs no table")
    try:
        return read_schedule(Path(args.budget_schedule))
    except ValueError as exc:
        raise UserError(f"--budget-schedule: {exc}") from None


def _bench_at(
    args: argparse.Namespace,
    engine: Any,
    encoded: list[list[int]],
    eos: tuple[int, ...],
    methods: list[str],
    size: int,
    sampling: Sampling,
    schedule: BudgetSchedule | None,
) -> list[Any]:
    """The rows at one batch size, at `sampling`, with an `auto` row on `schedule` where there is one: the
    header first, then the table."""
    from ddtree.bench.rows import format_rows, run_bench

    rounds = args.rounds or 1
    graphs = "CUDA graphs" if engine.cuda_graphs else "eager"
    batching = f"continuous batching in {size} slots" if args.continuous else f"batch {size}"
    target = engine.target
    print(
        f"{len(encoded)} prompts, {args.max_new_tokens} new tokens max, {batching}, "
        f"device {target.device}, {str(target.dtype).removeprefix('torch.')}, {graphs}, "
        f"rows interleaved per batch, {rounds} round{'s' if rounds > 1 else ''}, {sampling.describe()}",
        flush=True,
    )
    with ProgressBar(terminal=sys.stderr.isatty()) as bar:
        rows = run_bench(
            engine,
            encoded,
            args.budgets,
            args.max_new_tokens,
            size,
            methods,
            eos,
            rounds,
            bool(args.baseline),
            args.continuous,
            progress=bar,
            sampling=sampling,
            schedule=schedule,
            adaptive=args.max_budget if args.adaptive else None,
        )
    print(format_rows(rows))
    return rows


class ProgressBar:
    """A `ddtree.bench.rows.Progress` on stderr (or `stream`). On a terminal a tqdm bar, made on the first
    report, closed (leaving no trace) when the block ends; off one, a line `bench: 3/12 runs, warm-up ar, 41 s`
    once `PROGRESS_LINE_S` seconds have passed since the last (or the start), and for the last run."""

    def __init__(self, terminal: bool, stream: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.terminal = terminal
        self.stream = stream
        self.bar: Any = None
        self.clock = clock
        self.started = self.last_line = clock()

    def __call__(self, done: int, total: int, label: str) -> None:
        file = self.stream if self.stream is not None else sys.stderr
        if not self.terminal:
            now = self.clock()
            if done == total or now - self.last_line >= PROGRESS_LINE_S:
                print(f"bench: {done}/{total} runs, {label}, {now - self.started:.0f} s", file=file, flush=True)
                self.last_line = now
            return
        if self.bar is None:
            from tqdm import tqdm

            # a redraw per batch run (each takes far longer than a redraw), so the last run always shows
            self.bar = tqdm(
                total=total, desc="bench", unit="run", file=file, leave=False, dynamic_ncols=True, mininterval=0
            )
        self.bar.set_postfix_str(label, refresh=False)
        self.bar.update(done - self.bar.n)

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _write_outputs(args: argparse.Namespace, measured: list[tuple[int, Any]], sampling: Sampling) -> None:
    """`--out`: every row, with its batch size, the temperature and the seed;
    `--cost-curve`: ar's and ddtree's ms per step, one curve per batch size, each ddtree budget's tau beside
    its time, at the run's temperature (the `auto` row is no point of a curve)."""
    from ddtree.bench.rows import rows_json

    if args.json_out:
        records = rows_json([row for _, row in measured], sampling)
        records = [{"batch_size": size, **r} for (size, _), r in zip(measured, records, strict=True)]
        Path(args.json_out).write_text(json.dumps(records, indent=2))
    if args.cost_curve:
        from ddtree.bench.tune import cost_points
        from telemetry.analysis.cost import write_costs

        write_costs(Path(args.cost_curve), cost_points(measured), sampling.temperature)


def _tree_build_bench(args: argparse.Namespace) -> int:
    """`bench --tree-build`: the tree build alone on random logits, torch ops against the fused kernels."""
    from ddtree.bench.tree_build import time_tree_build
    from ddtree.models.pair import resolve_device

    device = str(resolve_device(args.device))
    print(f"tree build on {device}, depth 15, vocab 49152, random float32 logits; median ms", flush=True)
    print(f"{'batch':>6}{'budget':>8}{'torch':>10}{'triton':>10}")
    for batch in (1, 32):
        for budget in (32, 256):
            times = time_tree_build(device, batch, 15, 49152, budget, repeats=20)
            fused = f"{times['fused_ms']:.3f}" if "fused_ms" in times else "-"
            print(f"{batch:>6}{budget:>8}{times['torch_ms']:>10.3f}{fused:>10}")
    return 0


def _overhead(
    args: argparse.Namespace,
    paths: tuple[str, str | None],
    target: Any,
    tokenizer: Any,
    prompts: list[str],
    method: str,
    sampling: Sampling,
) -> int:
    """Telemetry as users turn it on: spans to an OTLP endpoint, Prometheus metrics, JSON step logs; every
    batch decodes at `sampling` (a batch's request i seeded seed + i)."""
    from ddtree.bench.rows import PairSpec, telemetry_overhead
    from ddtree.methods import method_label
    from ddtree.models.chat import chat_ids, eos_ids
    from ddtree.settings import GenerationConfig
    from telemetry.config import TelemetryConfig

    config = GenerationConfig(
        method=method,
        budget=args.budgets[0],
        temperature=sampling.temperature,
        seed=sampling.seed,
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=eos_ids(tokenizer, target),
    )
    env = TelemetryConfig.from_env()
    on = TelemetryConfig(
        enabled=True,
        traces_exporter=env.traces_exporter,
        metrics_exporter="prometheus",
        otlp_endpoint=env.otlp_endpoint,
        otlp_protocol=env.otlp_protocol,
        prometheus_port=0,
        log_file=env.log_file or os.devnull,
    )
    encoded = [chat_ids(tokenizer, p) for p in prompts]
    pair = PairSpec(paths[0], paths[1], args.device, args.dtype)
    off_tps, on_tps = telemetry_overhead(pair, encoded, config, args.batch_size, args.rounds or 4, on)
    label = method_label(method, args.budgets[0])
    print(f"{label}: telemetry off {off_tps:.1f} tok/s, on {on_tps:.1f} tok/s, on/off {on_tps / off_tps:.3f}")
    return 0
