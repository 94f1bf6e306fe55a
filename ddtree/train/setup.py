"""Glue for the `ddtree drafter` commands: build a drafter for a target, make data, run training."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ddtree.errors import UserError
from ddtree.models.dflash import DFlashDrafter, check_pair, default_feature_layers, drafter_config, load_drafter
from ddtree.models.target import read_target_config


def default_mask_token(target: str, config: Any) -> int:
    """The tokenizer's mask token if it has one, else unk, else pad, else the last id."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError):
        return int(config.vocab_size) - 1
    for name in ("<|mask|>", "<mask>", "[MASK]"):
        token_id = tok.convert_tokens_to_ids(name)
        if isinstance(token_id, int) and token_id != tok.unk_token_id and 0 <= token_id < config.vocab_size:
            return token_id
    for token_id in (tok.unk_token_id, tok.pad_token_id):
        if token_id is not None:
            return int(token_id)
    return int(config.vocab_size) - 1


def new_drafter(
    target: str,
    num_layers: int,
    num_features: int | None,
    block_size: int,
    mask_token_id: int | None,
    seed: int,
    feature_layers: list[int] | None = None,
) -> DFlashDrafter:
    """A randomly initialised drafter sized to the target in `target`, reading `feature_layers` of it (default:
    `num_features`, else `num_layers`, spread evenly by `default_feature_layers`)."""
    if num_layers < 1:
        raise UserError(f"--num-layers must be >= 1, got {num_layers}")
    if block_size < 2:
        raise UserError(f"--block-size must be >= 2, got {block_size}")
    if num_features is not None and num_features < 1:
        raise UserError(f"--num-features must be >= 1, got {num_features}")
    config = read_target_config(target)
    mask = mask_token_id if mask_token_id is not None else default_mask_token(target, config)
    if not 0 <= mask < config.vocab_size:
        raise UserError(f"--mask-token-id {mask} is outside the vocabulary (size {config.vocab_size})")
    if feature_layers is not None:
        wrong = [i for i in feature_layers if not 0 <= i < config.num_hidden_layers]
        if wrong or len(set(feature_layers)) != len(feature_layers):
            raise UserError(
                f"--feature-layers must be distinct layers of the target's 0..{config.num_hidden_layers - 1}, "
                f"got {','.join(map(str, feature_layers))}"
            )
    layers = feature_layers or default_feature_layers(config.num_hidden_layers, num_features or num_layers)
    torch.manual_seed(seed)
    return DFlashDrafter(drafter_config(config, num_layers, block_size, mask, feature_layers=layers))


def drafter_from_args(target: str, args: argparse.Namespace) -> DFlashDrafter:
    """`new_drafter` for the target in `target`, shaped by the shape flags of `drafter init` and `train`."""
    return new_drafter(
        target,
        args.num_layers,
        args.num_features,
        args.block_size,
        args.mask_token_id,
        args.seed,
        args.feature_layers,
    )


def target_or_default(target: str | None) -> str:
    """`target`, or the default target's directory (pulled on first use) when it is None."""
    if target is not None:
        return target
    from ddtree.models.default import default_target

    return str(default_target())


def run_training(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """Train a drafter per the `drafter train` arguments; returns the training report (with the held-out
    evaluation under "eval" when asked for)."""
    from transformers import AutoModelForCausalLM

    from ddtree.models.pair import resolve_device
    from ddtree.train.data import read_sequences
    from ddtree.train.heldout import HeldoutSet, encode_heldout
    from ddtree.train.runs import add_eval
    from ddtree.train.teacher import heldout_evaluator, heldout_teacher_eval
    from ddtree.train.trainer import REPORT_FILE, train

    if config.steps < 1 or config.batch_size < 1 or config.anchors < 1:
        raise UserError("--steps, --batch-size and --anchors must be >= 1")
    target_dir = target_or_default(args.target)
    target_config = read_target_config(target_dir)
    data = read_sequences(args.data)
    device = resolve_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    drafter = _start_drafter(args, target_dir, out, device)
    check_pair(drafter, target_config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target: Any = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype)
    target.to(device)
    evaluate = None
    if config.eval_every_seconds:
        from ddtree.models.pair import load_tokenizer

        tokenizer = load_tokenizer(target_dir)
        if tokenizer is None:
            raise UserError(f"--eval-every needs the target's tokenizer, and {target_dir!r} has none")
        evaluate = heldout_evaluator(target, tokenizer, drafter.to(device), encode_heldout(tokenizer, 64))
    try:
        report: dict[str, Any] = train(
            drafter.to(device), target, data, out, config, resume=args.resume, evaluate=evaluate
        )
        if args.eval_heldout:
            report["eval"] = heldout_teacher_eval(HeldoutSet.load(target_dir, str(out), args.device))
            add_eval(out, report["eval"])
            (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return report  # also in out/training.json; the run's record is in out/runs.json


def _start_drafter(args: argparse.Namespace, target_dir: str, out: Path, device: torch.device) -> DFlashDrafter:
    """The drafter of the trainer state in `out` when resuming from one, else `--init`'s (with its run
    records, where `out` has none), else a new one."""
    from ddtree.train.runs import inherit_runs
    from ddtree.train.state import STATE_FILE

    if args.resume and (out / STATE_FILE).is_file():
        return load_drafter(out, device, torch.float32)  # its shape is the state's; train() loads the weights
    if args.resume:
        print(f"ddtree: no trainer state in {str(out)!r}: training starts at step 0", file=sys.stderr)
    if args.init:
        inherit_runs(Path(args.init), out)  # the weights' history comes with them
        return load_drafter(args.init, device, torch.float32)
    return drafter_from_args(target_dir, args)
