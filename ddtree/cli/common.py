"""What every `ddtree` subcommand shares: the help formatter, examples, flag types and the device flags.

Help shows each option's default (unless it is None, False or empty, or the help already speaks of it),
keeps the examples of an epilog as written, wraps lines between words only (never inside `--a-flag`), and
lists an option's spellings once with one metavar (`--model, --target DIR`), as Python 3.13+ does, so that
the help reads the same on every Python.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ddtree.adaptive import ADAPTIVE, DEFAULT_MAX_BUDGET
from ddtree.errors import UserError
from ddtree.kernels import ATTENTION_CHOICES

if TYPE_CHECKING:
    from ddtree.runtime import EngineOptions

SEED_MAX = 2**32 - 1
# a setting's flag, where it is not --<setting with dashes>
FLAGS = {"schedule": "--budget-schedule", "adaptive": "--budget adaptive"}
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`ArgumentDefaultsHelpFormatter` without the noise: no "(default: None)", and epilogs kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower() or not _shown(action.default):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)  # `--max-minutes` stays whole

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return f"{', '.join(action.option_strings)} {metavar}"


def _shown(default: object) -> bool:
    return default is not None and default is not False and default != argparse.SUPPRESS and default not in ([], "")


def add_command(sub: Any, name: str, summary: str, examples: Sequence[str], **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand: `summary` in its parent's list and atop its own help, `examples` (command lines, `# `
    comments allowed) at the end of its help."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=summary[:1].upper() + summary[1:] + ".",
        epilog=examples_epilog(examples),
        formatter_class=HelpFormatter,
        **kwargs,
    )
    return parser


def deprecated(*names: str) -> str:
    """The help's note on an option's old spellings, which still work for a release."""
    return f" ({', '.join(names)}: deprecated alias)"


def prompt_set_args(parser: argparse.ArgumentParser, aliases: Sequence[str] = ()) -> None:
    """`--prompts FILE` and `--num-prompts N` (and its old `aliases`): a prompt set, the built-in held-out one
    unless told (`prompt_set` reads it)."""
    parser.add_argument(
        "--prompts", metavar="FILE", help="JSONL file of {'prompt': TEXT}; default: the built-in held-out set"
    )
    parser.add_argument(
        "--num-prompts",
        *aliases,
        dest="num_prompts",
        type=POSITIVE,
        metavar="N",
        help="use the first N prompts (default: all)" + (deprecated(*aliases) if aliases else ""),
    )


def prompt_set(args: argparse.Namespace) -> list[str]:
    """The prompts of `prompt_set_args`; UserError where there are none."""
    from ddtree.data import heldout_prompts

    prompts = heldout_prompts(args.prompts)[: args.num_prompts]
    if not prompts:
        raise UserError(f"no prompts in {args.prompts!r}")
    return prompts


def examples_epilog(examples: Sequence[str]) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in examples)


def iter_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every subcommand's parser below it, depth first, in the order they were added."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # an alias would list a parser twice
                yield from iter_parsers(child)


def flag_of(setting: str) -> str:
    """The flag that sets a library setting (`max_new_tokens`: `--max-new-tokens`), to name it in errors."""
    return FLAGS.get(setting, "--" + setting.replace("_", "-"))


def int_flag(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse `type=`: an integer in low..high (no upper bound without `high`), or an error that names
    the range and the value (argparse adds the flag)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_bounds(low, high)}, got {value}")
        return value

    return parse


def float_flag(low: float, high: float | None = None, above: bool = False) -> Callable[[str], float]:
    """An argparse `type=`: a finite number >= low (> low with `above`) and <= high."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
        if (value <= low if above else value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_bounds(low, high, above)}, got {value}")
        return value

    return parse


def _bounds(low: float, high: float | None, above: bool = False) -> str:
    if high is None:
        return f"{'>' if above else '>='} {low}"
    return f"in ({low}, {high}]" if above else f"in {low}..{high}"


SEED = int_flag(0, SEED_MAX)
POSITIVE = int_flag(1)


def budget_flag(*words: str) -> Callable[[str], int | str]:
    """A `--budget` value: a number >= 1, or one of `words` (`adaptive`, `auto`)."""

    def parse(text: str) -> int | str:
        return text if text in words else POSITIVE(text)

    return parse


def budget_args(parser: argparse.ArgumentParser, *words: str, help: str) -> None:
    """`--budget` (a number, or one of `words`, `adaptive` always among them) and `--max-budget`."""
    parser.add_argument("--budget", type=budget_flag(ADAPTIVE, *words), default=32, help=help)
    parser.add_argument(
        "--max-budget",
        type=POSITIVE,
        default=DEFAULT_MAX_BUDGET,
        help="with --budget adaptive: the widest tree a step may verify (each step chooses among 0, the powers of"
        " two below it, and it)",
    )


def tree_budget(args: argparse.Namespace) -> tuple[int, bool]:
    """The budget a run's trees are sized by, and whether each step chooses its width (`--budget adaptive`)."""
    return (args.max_budget, True) if args.budget == ADAPTIVE else (args.budget, False)


def ints(text: str) -> list[int]:
    """`1,2,3` -> [1, 2, 3]; ValueError with a readable reason otherwise."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"comma-separated integers expected, got {text!r}") from None
    if not values:
        raise ValueError("at least one integer expected")
    return values


def int_list(low: int, what: str = "integers") -> Callable[[str], list[int]]:
    """An argparse `type=`: comma-separated `what`, each >= `low`."""

    def parse(text: str) -> list[int]:
        try:
            values = ints(text)
        except ValueError:
            values = []
        if not values or min(values) < low:
            raise argparse.ArgumentTypeError(f"must be comma-separated {what} >= {low}, got {text!r}")
        return values

    return parse


budget_list = int_list(1)  # budgets, batch sizes: each >= 1


def model_args(parser: argparse.ArgumentParser, drafter: bool = True) -> None:
    """`--model` and `--drafter`: the pair, the default one (pulled on first use) where they are left out."""
    parser.add_argument("--model", metavar="DIR", help="target model directory (HF layout); default: the default pair")
    if drafter:
        parser.add_argument(
            "--drafter", metavar="DIR", help="DFlash drafter directory (dflash, ddtree); default: the default pair's"
        )


def device_args(parser: argparse.ArgumentParser, dtype: bool = True, graphs: bool = False) -> None:
    """`--device`, `--dtype` and, for the engine's commands, how it runs: graphs, tree kernel, attention."""
    parser.add_argument("--device", choices=DEVICES, default="auto", help="where to run (auto: cuda if available)")
    if dtype:
        parser.add_argument(
            "--dtype",
            choices=DTYPES,
            default="auto",
            help="weights and activations (auto: bfloat16 on CUDA, else float32)",
        )
    if not graphs:
        return
    parser.add_argument(
        "--cuda-graphs", choices=("auto", "on", "off"), default="auto", help="replay decode steps (auto: on CUDA)"
    )
    parser.add_argument(
        "--tree-kernel",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="tree build: torch ops or fused Triton (auto: Triton on CUDA where it imports)",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default="auto",
        help="attention (target, drafter): sdpa with a dense mask or the Triton tree kernel (auto: Triton on CUDA)",
    )


def engine_options(args: argparse.Namespace) -> EngineOptions:
    from ddtree.runtime import EngineOptions

    return EngineOptions(args.device, args.dtype, args.cuda_graphs, args.tree_kernel, args.attention)
