"""`ddtree drafter ...`: make, train and move DFlash drafters (argument glue over `ddtree.train`).

- init, data, train: a random drafter, training data (the target's responses), training.
- pack-data: JSONL data files or packed directories -> one packed data directory (about a third of the size of
  the JSONL), their sequences in the order given.
- state export / import: a drafter directory's trainer state <-> a compact bundle (`ddtree.train.state`).
- part / gather: bundles -> parts within file-count and size limits, and back (`ddtree.train.bundle`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ddtree.cli.common import (
    POSITIVE,
    SEED,
    add_command,
    budget_list,
    deprecated,
    device_args,
    float_flag,
    int_flag,
    int_list,
)
from ddtree.cli.drafter_head import add_head_parser
from ddtree.errors import UserError

MIB = 2**20
SHARD_MIB = float_flag(0, 1024, above=True)

# Names shared with the other subcommands (old spellings kept as aliases for a release):
# - `--model DIR` is the target, as in generate, bench and serve; `--target` is its old name (dest `target`).
# - `--num-prompts N`, as `bench` has it; `--out PATH` is what a command writes, so `part --dest` is `--out`.
# - `--device`, `--dtype`: the same choices and help as the engine's commands (`common.device_args`).
# - `--max-len` (train) cuts training sequences: not `serve --max-model-len`, which bounds a request.
TARGET_HELP = "target model directory (HF layout)"


def _target_arg(parser: argparse.ArgumentParser, required: bool = False) -> None:
    default = "" if required else "; default: the default target"
    parser.add_argument(
        "--model",
        "--target",
        dest="target",
        metavar="DIR",
        required=required,
        help=TARGET_HELP + default + deprecated("--target"),
    )


def add_parsers(sub: Any) -> None:
    examples = (
        "ddtree drafter init --model TARGET --out DRAFTER",
        "ddtree drafter train --model TARGET --data data.jsonl --out DRAFTER --steps 2000",
    )
    group = add_command(sub, "drafter", "make, train and move DFlash drafters", examples)
    drafter = group.add_subparsers(dest="drafter_command", required=True, title="commands", metavar="COMMAND")
    init = add_command(
        drafter,
        "init",
        "write a randomly initialised drafter for a target",
        ("ddtree drafter init --model TARGET --out DRAFTER --num-layers 2 --block-size 8",),
    )
    _target_arg(init, required=True)
    init.add_argument("--out", required=True, metavar="DIR", help="drafter directory to write")
    _shape_args(init, layers=1)
    init.set_defaults(func=_init)
    _data_parser(drafter)
    grow = add_command(
        drafter,
        "grow",
        "a deeper or wider drafter whose new layers and features add nothing yet (same drafts)",
        (
            "ddtree drafter grow DRAFTER --num-layers 4 --out DRAFTER4",
            "ddtree drafter grow DRAFTER --feature-layers 1,8,14,20,27 --out WIDER",
        ),
    )
    grow.add_argument("drafter", help="drafter directory to grow from")
    grow.add_argument("--num-layers", type=POSITIVE, default=None, help="layers of the grown drafter (default: same)")
    grow.add_argument(
        "--feature-layers",
        type=int_list(0, "layer indices"),
        default=None,
        metavar="LIST",
        help="the target layers the grown drafter reads, its own among them (default: its own)",
    )
    grow.add_argument("--out", required=True, metavar="DIR", help="drafter directory to write")
    grow.add_argument("--seed", type=SEED, default=0, help="initialises the new layers' other weights")
    grow.set_defaults(func=_grow)
    _train_parser(drafter)
    add_head_parser(drafter, _target_arg)
    _eval_parser(drafter)
    _travel_parsers(drafter)


def _data_parser(drafter: Any) -> None:
    examples = (
        "ddtree drafter data --model TARGET --out data.jsonl --num-prompts 2000",
        "ddtree drafter data --prompts prompts.jsonl --multi-turn 0.3 --out data.jsonl --batch-size 128",
    )
    summary = "write training data: the target's responses to training prompts"
    data = add_command(drafter, "data", summary, examples)
    _target_arg(data)
    data.add_argument("--out", required=True, metavar="FILE", help="JSONL file to write")
    data.add_argument(
        "--num-prompts",
        type=POSITIVE,
        default=2000,
        metavar="N",
        help="prompts: the first N of --prompts, or N built-in",
    )
    data.add_argument(
        "--prompts",
        metavar="FILE",
        help="JSONL file of {'prompt': TEXT} or {'messages': [TEXT, ...]} (user turns) instead of the built-in prompts",
    )
    data.add_argument(
        "--multi-turn",
        type=float_flag(0, 1),
        default=0.0,
        metavar="FRACTION",
        help="give about this fraction of the one-turn prompts a second user turn, asked after the target's reply",
    )
    data.add_argument(
        "--write-prompts", action="store_true", help="write the prompts to --out (as --prompts reads them) and stop"
    )
    data.add_argument(
        "--exclude-prompts",
        nargs="+",
        default=[],
        metavar="FILE",
        help="prompt files (as --prompts reads them) whose first turns the built-in prompts must not repeat",
    )
    data.add_argument("--max-new-tokens", type=POSITIVE, default=256, help="new tokens per reply, at most")
    data.add_argument("--batch-size", type=POSITIVE, default=64, help="prompts answered together")
    data.add_argument("--seed", type=SEED, default=0, help="picks and orders the prompts and follow-ups")
    device_args(data)
    data.set_defaults(func=_data)


def _shape_args(parser: argparse.ArgumentParser, layers: int) -> None:
    parser.add_argument("--num-layers", type=POSITIVE, default=layers, help="drafter layers")
    parser.add_argument(
        "--num-features",
        type=POSITIVE,
        default=None,
        help="target layers read, spread evenly from the second to the third-last (default: --num-layers)",
    )
    parser.add_argument(
        "--feature-layers",
        type=int_list(0, "layer indices"),
        default=None,
        metavar="LIST",
        help="the target layers read, by index, e.g. 1,7,14,20,27 (instead of --num-features)",
    )
    parser.add_argument(
        "--block-size", type=int_flag(2), default=16, help="tokens drafted per block, the anchor's included"
    )
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the initial weights (and of training)")
    parser.add_argument(
        "--mask-token-id", type=int_flag(0), default=None, help="default: the tokenizer's mask/unk/pad token"
    )


def _train_parser(drafter: Any) -> None:
    examples = (
        "ddtree drafter train --model TARGET --data data.jsonl --out DRAFTER --steps 2000 --eval-heldout",
        "ddtree drafter train --data packed/ --out DRAFTER --resume --max-minutes 60 --total-minutes 240",
    )
    train = add_command(drafter, "train", "train a DFlash drafter on the target's own responses", examples)
    _target_arg(train)
    train.add_argument(
        "--data", required=True, metavar="PATH", help="JSONL file of `drafter data`, or a directory of `pack-data`"
    )
    train.add_argument(
        "--out", required=True, metavar="DIR", help="drafter directory (checkpoints and runs.json land here too)"
    )
    _shape_args(train, layers=2)
    train.add_argument("--steps", type=POSITIVE, default=1000, help="optimizer steps")
    train.add_argument("--batch-size", type=POSITIVE, default=16, help="sequences per step")
    train.add_argument("--anchors", type=POSITIVE, default=32, help="blocks per sequence")
    train.add_argument("--lr", type=float_flag(0, above=True), default=6e-4, help="peak learning rate")
    train.add_argument(
        "--gamma", type=float_flag(0, above=True), default=7.0, help="loss weight exp(-(k-1)/gamma) at block position k"
    )
    train.add_argument(
        "--distill",
        choices=("ce", "kl", "ce+kl"),
        default="ce",
        help="ce: the data's tokens; kl: the target's distributions; ce+kl: the sum of both losses",
    )
    train.add_argument("--max-len", type=int_flag(2), default=512, help="tokens per training sequence, at most")
    train.add_argument("--checkpoint-every", type=POSITIVE, default=200, help="steps between checkpoints")
    train.add_argument(
        "--max-minutes", type=float_flag(0, above=True), default=None, help="this run's wall-clock limit"
    )
    train.add_argument(
        "--total-minutes",
        type=float_flag(0, above=True),
        default=None,
        help="training time over all runs that the LR schedule spans (default: --max-minutes); give it every run",
    )
    train.add_argument("--resume", action="store_true", help="continue from the trainer state in --out")
    train.add_argument(
        "--init", metavar="DIR", help="start from this drafter's weights (its shape wins over the shape options)"
    )
    train.add_argument(
        "--eval-every",
        type=float_flag(0, above=True),
        default=None,
        metavar="MINUTES",
        help="teacher-forced held-out tau every MINUTES of training and at the end, into runs.json (`evals`)",
    )
    train.add_argument(
        "--eval-heldout",
        action="store_true",
        help="after the run: tau of dflash and ddtree B=32 on 16 held-out prompts, stored in runs.json",
    )
    device_args(train, dtype=False)
    train.set_defaults(func=_train)


PER_DEPTH_LINES = (
    ("conditional", "chain, each depth's match rate once all drafts before it matched"),
    ("first_in_top", "depth 1, the target's token among the drafter's top 1..k"),
)


def _eval_parser(drafter: Any) -> None:
    examples = (
        "ddtree drafter eval  # the shipped drafter: dflash and ddtree B=32 on the 64 held-out prompts",
        "ddtree drafter eval DRAFTER --model TARGET --budgets 8,32,64 --decoded",
    )
    evaluate = add_command(
        drafter, "eval", "held-out acceptance of a drafter, teacher-forced: no decoding, one pass per reply", examples
    )
    evaluate.add_argument("drafter", nargs="?", help="drafter directory (default: the shipped drafter)")
    _target_arg(evaluate)
    evaluate.add_argument("--num-prompts", type=POSITIVE, default=64, help="the first N held-out prompts")
    evaluate.add_argument("--max-new-tokens", type=POSITIVE, default=64, help="tokens per reply, at most")
    evaluate.add_argument("--budgets", type=budget_list, default=[32], help="ddtree budgets, comma-separated")
    evaluate.add_argument(
        "--decoded", action="store_true", help="also decode as `ddtree bench` does (batch 16) and compare"
    )
    evaluate.add_argument(
        "--per-depth", action="store_true", help="also the chain's acceptance rate at each depth, and top-k at depth 1"
    )
    evaluate.add_argument("--json", action="store_true", help="print the figures as JSON")
    evaluate.add_argument("--no-head", action="store_true", help="build the marginal trees of a drafter with a head")
    device_args(evaluate, dtype=False)
    evaluate.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    from ddtree.models.default import default_drafter
    from ddtree.train.heldout import HeldoutSet, heldout_eval
    from ddtree.train.setup import target_or_default
    from ddtree.train.teacher import heldout_depth_profile, heldout_teacher_eval

    target, drafter = target_or_default(args.target), args.drafter or str(default_drafter())
    try:
        held = HeldoutSet.load(target, drafter, args.device, args.num_prompts)  # both measures' pair and prompts
        if args.no_head:
            held.drafter.transition = None
        result = {"teacher-forced": heldout_teacher_eval(held, args.max_new_tokens, budgets=args.budgets)}
        if args.decoded:
            result["decoded"] = heldout_eval(held, args.max_new_tokens, budgets=args.budgets)
        if args.per_depth:
            result["per-depth"] = heldout_depth_profile(held, args.max_new_tokens)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    ours = result["teacher-forced"]
    print(f"{ours['prompts']} held-out prompts, {ours['max_new_tokens']} new tokens, greedy, {ours['device']}")
    print(f"{'method':<16}{'teacher-forced':>16}" + (f"{'decoded':>10}{'apart':>8}" if args.decoded else ""))
    for label, tau in ours["tau"].items():
        line = f"{label:<16}{tau:>16.3f}"
        if args.decoded:
            decoded = result["decoded"]["tau"][label]
            line += f"{decoded:>10.3f}{(tau - decoded) / decoded:>+8.1%}"
        print(line)
    for key, what in PER_DEPTH_LINES if args.per_depth else ():
        print(f"{what}: " + " ".join(f"{v:.3f}" for v in result["per-depth"][key]))
    return 0


def _travel_parsers(drafter: Any) -> None:
    pack = add_command(
        drafter,
        "pack-data",
        "JSONL data files or packed directories -> one packed data directory (safetensors shards)",
        ("ddtree drafter pack-data data-1.jsonl data-2.jsonl packed/",),
    )
    pack.add_argument("data", nargs="+", help="JSONL files of `drafter data` or directories of `pack-data`, merged")
    pack.add_argument("out", help="output directory (data.json and data-*.safetensors)")
    pack.add_argument("--shard-mib", type=SHARD_MIB, default=15.0, help="the most one shard file holds, in MiB")
    pack.set_defaults(func=_pack_data)
    _state_parsers(drafter)
    part = add_command(
        drafter,
        "part",
        "copy one part of the files of bundles, within file and size limits",
        (
            "ddtree drafter part state/ packed/ --out part1/ --part 1",
            "ddtree drafter part state/ packed/ --out part2/ --part 2",
        ),
    )
    part.add_argument("bundles", nargs="+", help="bundle directories (a state, packed data)")
    part.add_argument(
        "--out",
        "--dest",
        dest="dest",
        required=True,
        metavar="DIR",
        help="directory to copy the part's files into" + deprecated("--dest"),
    )
    part.add_argument("--part", type=POSITIVE, default=1, help="which part, from 1 (the output names their number)")
    part.add_argument("--max-files", type=int_flag(2), default=7, help="files per part, manifests included")
    part.add_argument("--max-mib", type=float_flag(0, above=True), default=44.0, help="bytes per part, in MiB")
    part.set_defaults(func=_part)
    gather = add_command(
        drafter,
        "gather",
        "collect the bundle files of one part into ROOT/<bundle name>/",
        ("ddtree drafter gather part1/ bundles/ && ddtree drafter gather part2/ bundles/",),
    )
    gather.add_argument("source", help="a directory holding a part's files")
    gather.add_argument("root", help="where the bundles are put together (ROOT/state, ROOT/data)")
    gather.set_defaults(func=_gather)


def _state_parsers(drafter: Any) -> None:
    examples = ("ddtree drafter state export DRAFTER state/", "ddtree drafter state import state/ DRAFTER")
    group = add_command(drafter, "state", "the trainer state as a compact bundle, and back", examples)
    state = group.add_subparsers(dest="state_command", required=True, title="commands", metavar="COMMAND")
    export = add_command(
        state,
        "export",
        "a drafter directory's trainer state -> state.json + shards",
        ("ddtree drafter state export DRAFTER state/ --shard-mib 15",),
    )
    export.add_argument("drafter", help="drafter directory with trainer_state.pt")
    export.add_argument("out", help="output directory")
    export.add_argument("--shard-mib", type=SHARD_MIB, default=15.0, help="the most one shard file holds, in MiB")
    export.set_defaults(func=_state_export)
    imp = add_command(
        state,
        "import",
        "a complete state bundle -> a drafter directory that training resumes",
        ("ddtree drafter state import state/ DRAFTER  # then: drafter train --resume --out DRAFTER ...",),
    )
    imp.add_argument("bundle", help="directory with state.json and all its shards")
    imp.add_argument("drafter", help="drafter directory to write")
    imp.set_defaults(func=_state_import)


@contextlib.contextmanager
def _as_user_errors() -> Iterator[None]:
    """Library errors (bad values, unreadable files) reach the user as one line."""
    try:
        yield
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc


def _shard_bytes(mib: float) -> int:
    return int(mib * MIB)  # SHARD_MIB checked the range


def _init(args: argparse.Namespace) -> int:
    from ddtree.models.dflash import save_drafter
    from ddtree.train.setup import drafter_from_args

    drafter = drafter_from_args(args.target, args)
    save_drafter(drafter, args.out)
    print(f"wrote a random DFlash drafter ({args.num_layers} layers, block {args.block_size}) to {args.out}")
    return 0


def _grow(args: argparse.Namespace) -> int:
    import torch
    from safetensors import safe_open

    from ddtree.models.dflash import WEIGHTS_NAME, load_drafter, save_drafter
    from ddtree.train.grow import grow_drafter

    source = load_drafter(args.drafter, torch.device("cpu"), torch.float32)
    with safe_open(str(Path(args.drafter) / WEIGHTS_NAME), "pt") as f:
        dtype = f.get_tensor(next(iter(f.keys()))).dtype  # the grown drafter is saved as its source was
    layers = len(source.layers) if args.num_layers is None else args.num_layers
    try:
        grown = grow_drafter(source, layers, args.seed, args.feature_layers)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    save_drafter(grown, args.out, dtype)
    features = ",".join(str(i) for i in grown.target_layer_ids)
    print(
        f"wrote a {layers}-layer drafter reading target layers {features}, grown from {len(source.layers)} layers"
        f" reading {','.join(str(i) for i in source.target_layer_ids)}, to {args.out}"
    )
    return 0


def _data(args: argparse.Namespace) -> int:
    from ddtree.data import heldout_prompts
    from ddtree.train.data import write_training_data
    from ddtree.train.prompts import add_follow_ups, read_prompt_file, training_prompts, write_prompt_file

    if args.prompts:
        conversations = read_prompt_file(args.prompts)[: args.num_prompts]
        if not conversations:
            raise UserError(f"no prompts in {args.prompts!r}")
    else:
        used = {conversation[0] for path in args.exclude_prompts for conversation in read_prompt_file(path)}
        texts = training_prompts(args.num_prompts, seed=args.seed, exclude=used | set(heldout_prompts()))
        conversations = [[text] for text in texts]
    conversations = add_follow_ups(conversations, args.multi_turn, seed=args.seed)
    if args.write_prompts:
        write_prompt_file(args.out, conversations)
        print(f"wrote {len(conversations)} prompts to {args.out}")
        return 0
    count = write_training_data(
        args.target, args.out, conversations, args.max_new_tokens, args.batch_size, args.device, args.dtype
    )
    print(f"wrote {count} sequences to {args.out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from ddtree.train.setup import run_training
    from ddtree.train.trainer import TrainConfig

    config = TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        anchors=args.anchors,
        lr=args.lr,
        gamma=args.gamma,
        max_len=args.max_len,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        max_seconds=args.max_minutes * 60 if args.max_minutes else None,
        total_seconds=args.total_minutes * 60 if args.total_minutes else None,
        distill=args.distill,
        eval_every_seconds=args.eval_every * 60 if args.eval_every else None,
    )
    report = run_training(args, config)
    print(json.dumps(report))
    return 0


def _pack_data(args: argparse.Namespace) -> int:
    from ddtree.train.data import pack_sequences, read_sequences

    shard_bytes = _shard_bytes(args.shard_mib)
    with _as_user_errors():
        sequences = [seq for path in args.data for seq in read_sequences(path, min_response=0)]
        meta = pack_sequences(sequences, Path(args.out), shard_bytes)
    print(f"packed {meta['sequences']} sequences ({meta['tokens']} tokens, {meta['ids_dtype']}) into {args.out}")
    return 0


def _state_export(args: argparse.Namespace) -> int:
    from ddtree.train.state import export_state

    shard_bytes = _shard_bytes(args.shard_mib)
    with _as_user_errors():
        manifest = export_state(Path(args.drafter), Path(args.out), shard_bytes)
    size = sum(f.bytes for f in manifest.files) / MIB
    step, shards = manifest.meta["step"], len(manifest.files)
    print(f"wrote the trainer state at step {step} to {args.out}: {shards} shards, {size:.1f} MiB")
    return 0


def _state_import(args: argparse.Namespace) -> int:
    from ddtree.train.state import import_state

    with _as_user_errors():
        done = import_state(Path(args.bundle), Path(args.drafter))
    minutes = done["elapsed"] / 60
    print(f"imported the trainer state at step {done['step']} ({minutes:.1f} min of training) into {args.drafter}")
    return 0


def _part(args: argparse.Namespace) -> int:
    from ddtree.train.bundle import copy_part

    with _as_user_errors():
        names, count = copy_part(
            [Path(b) for b in args.bundles], Path(args.dest), args.part, args.max_files, int(args.max_mib * MIB)
        )
    print(f"part {args.part} of {count}: {' '.join(names)}")
    return 0


def _gather(args: argparse.Namespace) -> int:
    from ddtree.train.bundle import gather

    with _as_user_errors():
        missing = gather(Path(args.source), Path(args.root))
    for name, absent in missing.items():
        where = Path(args.root) / name
        print(f"{name}: complete in {where}" if not absent else f"{name}: still missing {' '.join(absent)}")
    return 0
