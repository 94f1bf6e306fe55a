"""`ddtree tune`: measure the budget schedule of a pair on this device and write it where `ddtree serve --budget
auto` finds it (argument glue over `ddtree.bench.tune`).

It says what it will run and about how long that takes before it starts; on a terminal a progress bar on
stderr counts each phase's runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddtree.cli.common import (
    POSITIVE,
    SEED,
    add_command,
    budget_list,
    device_args,
    engine_options,
    float_flag,
    model_args,
    prompt_set,
    prompt_set_args,
)
from ddtree.errors import UserError

if TYPE_CHECKING:
    from ddtree.bench.tune import TuneSettings
    from ddtree.models.dflash import DFlashDrafter
    from ddtree.models.target import Target
    from ddtree.runtime import EngineOptions
    from telemetry.analysis.schedule import Plan

EXAMPLES = (
    "ddtree tune  # the default pair, the held-out prompts; then: ddtree serve --budget auto",
    "ddtree tune --model TARGET --drafter DRAFTER --prompts mine.jsonl --batch-sizes 1,8,32",
    "ddtree tune --num-prompts 8 --max-new-tokens 32 --budgets 4,16 --batch-sizes 1,4 --out s.json",
)


def add_parser(sub: Any) -> None:
    tune = add_command(
        sub, "tune", "measure the budget for every load and write the schedule `serve --budget auto` follows", EXAMPLES
    )
    model_args(tune)
    prompt_set_args(tune)
    tune.add_argument("--max-new-tokens", type=POSITIVE, default=128, help="new tokens per prompt, at most")
    tune.add_argument(
        "--budgets", type=budget_list, default=[4, 8, 16, 32, 64], help="budgets to time (the largest is logged)"
    )
    tune.add_argument(
        "--batch-sizes", type=budget_list, default=[1, 4, 16, 64], help="loads (requests decoding together) to time"
    )
    tune.add_argument("--log-slots", type=POSITIVE, default=16, help="slots of the logged run")
    tune.add_argument("--temperature", type=float_flag(0), default=0.0, help="sampling temperature, as served")
    tune.add_argument("--seed", type=SEED, default=0, help="prompt i samples with seed + i (T > 0)")
    tune.add_argument("--out", metavar="FILE", help="write the schedule here (default: where serve looks for it)")
    tune.add_argument(
        "--keep",
        metavar="DIR",
        help="keep the logged run and the cost curves in this directory; a run on the same pair, prompts and "
        "settings resumes there, measuring only what is not yet kept",
    )
    device_args(tune, graphs=True)
    tune.set_defaults(func=_tune)


def _tune(args: argparse.Namespace) -> int:
    from ddtree.bench.rows import Sampling
    from ddtree.bench.tune import TuneSettings
    from ddtree.models.chat import chat_ids, eos_ids
    from ddtree.runtime import pair_identity, resolve_paths, schedule_path

    try:
        sampling = Sampling(args.temperature, args.seed)
        settings = TuneSettings(
            tuple(args.budgets), tuple(args.batch_sizes), args.max_new_tokens, args.log_slots, sampling
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    options = engine_options(args)
    options.check()
    prompts = prompt_set(args)
    model, drafter_dir = resolve_paths(args.model, args.drafter, "ddtree")
    target, drafter, tokenizer = options.load_models(model, drafter_dir)
    if tokenizer is None:
        raise UserError("tune needs a model with a tokenizer")
    identity = pair_identity(model, drafter_dir, target)
    out = Path(args.out) if args.out else schedule_path(identity)
    encoded = [chat_ids(tokenizer, p) for p in prompts]
    eos = eos_ids(tokenizer, target)
    with tempfile.TemporaryDirectory(prefix="ddtree-tune-") as scratch:
        work = Path(args.keep) if args.keep else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        plan = _phases(options, (target, drafter), encoded, eos, settings, work, identity)
    from ddtree.schedule import write_schedule

    write_schedule(out, plan.schedule)
    print(plan.table())
    print(f"wrote the schedule to {out}; `ddtree serve --budget auto` follows it on this pair and device")
    return 0


def _phases(
    options: EngineOptions,
    pair: tuple[Target, DFlashDrafter | None],
    encoded: list[list[int]],
    eos: tuple[int, ...],
    settings: TuneSettings,
    work: Path,
    identity: dict[str, str],
) -> Plan:
    """The three phases of `ddtree.bench.tune`, each announced; the plan."""
    from ddtree.bench.tune import Kept, cost_curves, estimate_seconds, logged_run
    from ddtree.cli.bench import ProgressBar
    from telemetry.analysis.digest import Digest
    from telemetry.analysis.schedule import plan_schedule

    target, drafter = pair
    engine = options.engine(target, drafter)
    minutes = estimate_seconds(engine, encoded, settings) / 60
    sizes = ",".join(map(str, settings.batch_sizes))
    print(
        f"ddtree tune: {len(encoded)} prompts, {settings.max_new_tokens} new tokens, {settings.sampling.describe()}; "
        f"1. a logged run at B={settings.log_budget} in {settings.log_slots} slots, 2. ar and budgets "
        f"{','.join(map(str, settings.budgets))} at batch sizes {sizes}, 3. the plan; "
        f"about {max(minutes, 0.1):.1f} min (from two timed steps; compiling and capturing come on top)",
        flush=True,
    )
    kept = Kept.of(work, encoded, settings, identity)
    if kept.log_finished():
        print(f"1/3 the logged run: kept in {work}", flush=True)
        with kept.log.open() as lines:
            digest = Digest.of(lines)
    else:
        print("1/3 the logged run", flush=True)
        digest = logged_run(partial(options.engine, target, drafter), target, encoded, eos, settings, kept.log)
        kept.finish_log()
    done = [str(size) for size in settings.batch_sizes if kept.points(size) is not None]
    print(f"2/3 cost curves at batch sizes {sizes}" + (f" ({','.join(done)} kept)" if done else ""), flush=True)
    bars = [ProgressBar(terminal=sys.stderr.isatty()) for _ in settings.batch_sizes]
    try:
        costs = cost_curves(
            engine,
            encoded,
            eos,
            settings,
            work / "tune-costs.json",
            lambda size: bars[settings.batch_sizes.index(size)],
            kept,
        )
    finally:
        for bar in bars:
            bar.__exit__()
    print("3/3 the plan", flush=True)
    try:
        return plan_schedule(costs, digest, tuned_for=identity)
    except ValueError as exc:
        raise UserError(f"no schedule: {exc}") from exc
