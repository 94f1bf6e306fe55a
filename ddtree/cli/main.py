"""The `ddtree` command: generate and models (pull, verify, init-tiny) here; bench, serve, analyze, advise and
drafter in the modules beside it, each subcommand's flags, help and examples with it.

One name per idea across the subcommands (old spellings kept as aliases for a release, marked in `--help`):
`--model DIR` is the target everywhere (`drafter ... --target` is its old name); `--json` is a flag that
prints JSON on stdout (generate, advise), `--out PATH` names what a command writes (`bench --json FILE` is
its old name); `--cost-curve FILE` is the step-time file in bench and advise (`advise --cost` is its old
name); `--num-prompts N` takes the first N prompts in bench and drafter data (`bench --limit` is its old
name); `--out DIR` is where `drafter part` copies to (`--dest` is its old name). Errors name the spelling
typed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, NoReturn

from ddtree.cli import analysis as cli_analysis
from ddtree.cli import bench as cli_bench
from ddtree.cli import drafter as cli_drafter
from ddtree.cli import serve as cli_serve
from ddtree.cli import tune as cli_tune
from ddtree.cli.common import (
    POSITIVE,
    SEED,
    HelpFormatter,
    add_command,
    budget_args,
    device_args,
    engine_options,
    examples_epilog,
    flag_of,
    float_flag,
    int_flag,
    ints,
    model_args,
    tree_budget,
)
from ddtree.errors import CapacityError, SettingsError, UserError
from ddtree.methods import METHOD_NAMES
from telemetry.config import TelemetryConfigError

EXIT_USAGE = 2
EXIT_MISMATCH = 1  # `models verify` found files that do not match the cache's manifest
EXAMPLES = (
    "ddtree generate --prompt 'What is the capital of France?'  # the default pair, pulled on first use",
    "ddtree bench --num-prompts 8 --budgets 16,32",
    "ddtree serve --port 8000",
)
_ARGV: ContextVar[Sequence[str]] = ContextVar("argv", default=())  # what `main` parses, for error messages


class _Parser(argparse.ArgumentParser):
    """argparse whose errors reach `main` as a UserError of one line: `--budget must be >= 1, got 0`, naming
    an option by the spelling typed (`--limit`, not `--num-prompts/--limit`)."""

    def error(self, message: str) -> NoReturn:
        named = re.fullmatch(r"argument (\S+): (.*)", message, re.DOTALL)
        if named is None:
            raise UserError(message)
        flag, problem = _typed(named[1].split("/"), _ARGV.get()), named[2]
        raise UserError(f"{flag} {problem}" if problem.startswith("must ") else f"argument {flag}: {problem}")


def _typed(spellings: list[str], argv: Sequence[str]) -> str:
    """The spelling of an option that `argv` uses, else its first (primary) one."""
    used = (s for s in spellings if any(a == s or a.startswith(f"{s}=") for a in argv))
    return next(used, spellings[0])


def version() -> str:
    """The installed distribution's version, or the package's own where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("ddtree")
    except metadata.PackageNotFoundError:
        import ddtree

        return ddtree.__version__


def main(argv: Sequence[str] | None = None) -> int:
    _ARGV.set(list(sys.argv[1:] if argv is None else argv))
    try:
        args = build_parser().parse_args(argv)
        result: int = args.func(args)
        return result
    except (UserError, CapacityError, TelemetryConfigError, SettingsError) as exc:
        message = exc.named(flag_of(exc.setting)) if isinstance(exc, SettingsError) else str(exc)
        print(f"ddtree: error: {' '.join(message.split())}", file=sys.stderr)  # one line
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (`| head`): end quietly, without a second error when Python flushes stdout.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("ddtree: interrupted", file=sys.stderr)
        return 130


def _tiny_hidden(text: str) -> int:
    value = int_flag(8, 4096)(text)
    if value % 8:
        raise argparse.ArgumentTypeError(f"must be a multiple of 8 (4 heads, even head size), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand with its flags, help and examples."""
    parser = _Parser(
        prog="ddtree",
        description="DDTree speculative decoding: generate, benchmark and serve with a draft tree, and train drafters.",
        epilog=examples_epilog(EXAMPLES) + "\n\n`ddtree COMMAND --help` shows a command's options and examples.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ddtree {version()}", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    _generate_parser(sub)
    cli_bench.add_parser(sub)
    cli_serve.add_parser(sub)
    cli_tune.add_parser(sub)
    cli_analysis.add_parsers(sub)  # analyze, advise
    _models_parsers(sub)
    cli_drafter.add_parsers(sub)  # drafter init, data, grow, train, pack-data, state, part, gather
    return parser


def _generate_parser(sub: Any) -> None:
    examples = (
        "ddtree generate --prompt 'Write a haiku about trees.' --max-new-tokens 64",
        "ddtree generate --model TARGET --drafter DRAFTER --budget 16 --prompt hi --prompt bye --json",
    )
    gen = add_command(sub, "generate", "generate text with ar, dflash or ddtree decoding", examples)
    model_args(gen)
    gen.add_argument("--method", choices=METHOD_NAMES, default="ddtree", help="decoding method (ar: no drafter)")
    budget_args(
        gen,
        help="draft tree nodes per step (ddtree), or 'adaptive': per step, the width the step's own tree"
        " predicts pays most, up to --max-budget",
    )
    gen.add_argument(
        "--topk", type=POSITIVE, default=None, help="candidates per depth (default: min(budget, vocabulary))"
    )
    gen.add_argument("--temperature", type=float_flag(0), default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--seed", type=SEED, default=0, help="seed of the sampler")
    gen.add_argument("--max-new-tokens", type=POSITIVE, default=128, help="new tokens per prompt, at most")
    device_args(gen, graphs=True)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", metavar="TEXT", help="prompt text; repeat for a batch")
    prompt.add_argument(
        "--prompt-ids", action="append", metavar="IDS", help="comma-separated token ids; repeat for a batch"
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap text prompts in the model's chat template (always for the default pair)",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt (JSON lines) on stdout")
    gen.set_defaults(func=_generate)


def _models_parsers(sub: Any) -> None:
    examples = ("ddtree models pull", "ddtree models verify", "ddtree models init-tiny --out runs/tiny-target")
    models = add_command(sub, "models", "fetch, check and make target models", examples)
    commands = models.add_subparsers(dest="models_command", required=True, title="commands", metavar="COMMAND")
    pull = add_command(
        commands, "pull", "fetch and convert the default target (SmolLM2-135M-Instruct)", ("ddtree models pull",)
    )
    pull.add_argument("name", nargs="?", default="smollm2-135m", help="the model to fetch")
    pull.set_defaults(func=_models_pull)
    verify = add_command(
        commands,
        "verify",
        "hash every cached file against the cache's manifest (exit 1: damage)",
        ("ddtree models verify", "ddtree models verify smollm2-135m"),
    )
    verify.add_argument("name", nargs="?", default=None, help="one cached model (default: every one)")
    verify.set_defaults(func=_models_verify)
    tiny = add_command(
        commands,
        "init-tiny",
        "write a random tiny Llama target with a byte tokenizer",
        ("ddtree models init-tiny --out runs/tiny-target --hidden-size 32 --num-layers 2",),
    )
    tiny.add_argument("--out", required=True, metavar="DIR", help="directory to write the model to")
    tiny.add_argument("--seed", type=SEED, default=0, help="seed of the random weights")
    tiny.add_argument("--hidden-size", type=_tiny_hidden, default=64, help="hidden size, a multiple of 8")
    tiny.add_argument("--num-layers", type=int_flag(1, 64), default=4, help="decoder layers")
    tiny.set_defaults(func=_models_init_tiny)


def _generate(args: argparse.Namespace) -> int:
    from ddtree.methods import mean_acceptance_length
    from ddtree.runtime import GenerateRequest, run_generate
    from ddtree.settings import GenerationConfig

    budget, adaptive = tree_budget(args)
    generation = GenerationConfig(
        method=args.method,
        budget=budget,
        adaptive=adaptive,
        topk=args.topk,
        temperature=args.temperature,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    )
    request = GenerateRequest(
        model=args.model,
        drafter=args.drafter,
        generation=generation,
        options=engine_options(args),
        prompts=args.prompt,
        prompt_ids=[_parse_ids(text) for text in args.prompt_ids] if args.prompt_ids else None,
        chat=args.chat or (args.model is None and args.prompt is not None),
    )
    for record in run_generate(request):
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(record["text"], flush=True)
            tau = mean_acceptance_length(record["acceptance_lengths"])
            shown = f"{tau:.2f}" if tau is not None else "-"
            print(
                f"[{record['steps']} steps, tau {shown}, {record['tokens_per_second']:.1f} tokens/s]", file=sys.stderr
            )
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        return ints(text)
    except ValueError as exc:
        raise UserError(f"--prompt-ids: {exc}") from None


def _models_verify(args: argparse.Namespace) -> int:
    from ddtree.models.cache import ddtree_home
    from ddtree.models.pull import verify_models

    results = verify_models(args.name)
    for path, problem in results:
        print(f"ok   {path}" if problem is None else f"BAD  {path}: {problem}")
    bad = sum(problem is not None for _, problem in results)
    if not results:
        print(f"no cached models under {ddtree_home() / 'models'}")
    elif bad:
        print(f"ddtree: {bad} of {len(results)} cached files do not match; `models pull` rebuilds", file=sys.stderr)
    return EXIT_MISMATCH if bad else 0


def _models_pull(args: argparse.Namespace) -> int:
    from ddtree.models.pull import pull

    print(pull(args.name))
    return 0


def _models_init_tiny(args: argparse.Namespace) -> int:
    from ddtree.models.tiny import write_tiny_target

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out!r} is a file, not a directory")
    out = write_tiny_target(Path(args.out), seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers)
    print(f"wrote a random tiny Llama target to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
