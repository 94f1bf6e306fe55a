"""The `ddtree` command: generate, drafter init, models init-tiny."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddtree.errors import UserError

EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except UserError as exc:
        print(f"ddtree: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        sys.stderr.close()  # the reader went away (`| head`): end quietly
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree", description="DDTree speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with ar, dflash or ddtree decoding")
    gen.add_argument("--model", required=True, help="target model directory (HF layout)")
    gen.add_argument("--drafter", help="DFlash drafter directory (needed by dflash and ddtree)")
    gen.add_argument("--method", choices=("ar", "dflash", "ddtree"), default="ddtree")
    gen.add_argument("--budget", type=int, default=32, help="draft tree nodes per step (ddtree)")
    gen.add_argument("--topk", type=int, default=None, help="candidates per depth (default min(budget, vocab))")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    gen.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16", "float64"), default="auto")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append", help="prompt text; repeat for a batch")
    prompt.add_argument("--prompt-ids", action="append", help="comma-separated token ids; repeat for a batch")
    gen.add_argument("--chat", action="store_true", help="wrap text prompts in the model's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.set_defaults(func=_generate)

    drafter = sub.add_parser("drafter", help="DFlash drafter tools").add_subparsers(
        dest="drafter_command", required=True
    )
    init = drafter.add_parser("init", help="write a randomly initialised drafter for a target")
    init.add_argument("--target", required=True, help="target model directory")
    init.add_argument("--out", required=True, help="output directory")
    init.add_argument("--num-layers", type=int, default=1)
    init.add_argument("--block-size", type=int, default=16)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's mask/unk/pad token")
    init.set_defaults(func=_drafter_init)

    models = sub.add_parser("models", help="model tools").add_subparsers(dest="models_command", required=True)
    tiny = models.add_parser("init-tiny", help="write a random tiny Llama target with a byte tokenizer")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--num-layers", type=int, default=4)
    tiny.set_defaults(func=_models_init_tiny)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from ddtree.runtime import GenerateRequest, run_generate

    request = GenerateRequest(
        model=args.model,
        drafter=args.drafter,
        method=args.method,
        budget=args.budget,
        topk=args.topk,
        temperature=args.temperature,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        device=args.device,
        dtype=args.dtype,
        prompts=args.prompt,
        prompt_ids=[_parse_ids(text) for text in args.prompt_ids] if args.prompt_ids else None,
        chat=args.chat,
    )
    for record in run_generate(request):
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(record["text"], flush=True)
            print(
                f"[{record['steps']} steps, mean acceptance {_mean(record['acceptance_lengths']):.2f}, "
                f"{record['tokens_per_second']:.1f} tokens/s]",
                file=sys.stderr,
            )
    return 0


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise UserError(f"--prompt-ids must be comma-separated integers, got {text!r}") from exc
    if not ids:
        raise UserError("--prompt-ids is empty")
    return ids


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def _drafter_init(args: argparse.Namespace) -> int:
    import torch

    from ddtree.models.dflash import DFlashDrafter, drafter_config, save_drafter
    from ddtree.models.target import read_target_config

    if args.num_layers < 1:
        raise UserError(f"--num-layers must be >= 1, got {args.num_layers}")
    if args.block_size < 2:
        raise UserError(f"--block-size must be >= 2, got {args.block_size}")
    config = read_target_config(args.target)
    mask = args.mask_token_id if args.mask_token_id is not None else _default_mask_token(args.target, config)
    if not 0 <= mask < config.vocab_size:
        raise UserError(f"--mask-token-id {mask} is outside the vocabulary (size {config.vocab_size})")
    torch.manual_seed(args.seed)
    drafter = DFlashDrafter(drafter_config(config, args.num_layers, args.block_size, mask))
    save_drafter(drafter, args.out)
    print(f"wrote a random DFlash drafter ({args.num_layers} layers, block {args.block_size}) to {args.out}")
    return 0


def _default_mask_token(target: str, config: Any) -> int:
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


def _models_init_tiny(args: argparse.Namespace) -> int:
    from ddtree.models.tiny import write_tiny_target

    out = write_tiny_target(Path(args.out), seed=args.seed, hidden_size=args.hidden_size, num_layers=args.num_layers)
    print(f"wrote a random tiny Llama target to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
