"""`ddtree drafter train-head`: a Markov head for a drafter (argument glue over `ddtree.train.markov`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ddtree.cli.common import POSITIVE, SEED, add_command, device_args, float_flag
from ddtree.errors import UserError


def add_head_parser(drafter: Any, target_arg: Any) -> None:
    examples = (
        "ddtree drafter train-head DRAFTER --model TARGET --data data.jsonl --out HEADED",
        "ddtree drafter eval DRAFTER --model TARGET --budgets 32  # with the head; --no-head: without",
    )
    head = add_command(
        drafter,
        "train-head",
        "train a Markov head (each depth conditioned on the token drafted above) for a drafter",
        examples,
    )
    head.add_argument("drafter", help="drafter directory (the head is written beside its weights)")
    target_arg(head, required=True)
    head.add_argument(
        "--data", required=True, help="training data: a JSONL file of `drafter data` or a packed directory"
    )
    head.add_argument("--out", metavar="DIR", default=None, help="write drafter and head here (default: DRAFTER)")
    head.add_argument("--rank", type=POSITIVE, default=32, help="rank of the head's bigram")
    head.add_argument("--steps", type=POSITIVE, default=1000, help="optimizer steps, at most (the best is kept)")
    head.add_argument("--lr", type=float_flag(0, above=True), default=1e-3, help="learning rate")
    head.add_argument("--max-sequences", type=POSITIVE, default=2000, help="training sequences read, at most")
    head.add_argument("--seed", type=SEED, default=0, help="seed of the head's initial weights and batches")
    device_args(head, dtype=False)
    head.set_defaults(func=_train_head)


def _train_head(args: argparse.Namespace) -> int:
    from ddtree.train.markov import run_head_training

    try:
        report = run_head_training(
            args.target, args.drafter, args.data, args.out, args.rank, args.steps, args.lr, args.max_sequences,
            args.device, args.seed,
        )  # fmt: skip
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    print(json.dumps(report))
    return 0
