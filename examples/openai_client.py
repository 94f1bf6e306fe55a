"""A chat completion from a running `ddtree serve`, with the official `openai` client: one whole, one streamed.

    ddtree serve --port 8000 &                         # the default pair; or --model DIR --drafter DIR
    pip install openai
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --prompt "Explain recursion."

The server speaks OpenAI's format and adds a `ddtree` block to each whole response, and to the last chunk of a
stream: the method, budget and top-k it verifies, the decode steps, tau (`mean_acceptance_length`) and the
acceptance histogram. The model needs a chat template (the default pair has one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

try:
    import openai
except ImportError:
    sys.exit("this example needs the openai package: pip install openai")


def ddtree_block(response: Any) -> dict[str, Any] | None:
    """The server's `ddtree` block: a field the openai client keeps among the response's extra fields."""
    extra = getattr(response, "model_extra", None) or {}
    block = extra.get("ddtree")
    return block if isinstance(block, dict) else None


def show(block: dict[str, Any] | None) -> None:
    print(f"ddtree: {json.dumps(block)}" if block is not None else "ddtree: (no ddtree block in the response)")


def main() -> int:
    parser = argparse.ArgumentParser(description="Chat with a running `ddtree serve` through the openai client.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY") or "none", help="$DDTREE_API_KEY")
    parser.add_argument("--model", help="the served model's id (default: the first /v1/models lists)")
    parser.add_argument("--prompt", default="Write a haiku about trees.")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": args.prompt}]
    try:
        model = args.model or client.models.list().data[0].id
        print(f"model: {model}")

        whole = client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens, temperature=0
        )
        print("--- whole")
        print(whole.choices[0].message.content)
        print(f"finish_reason: {whole.choices[0].finish_reason}")
        if whole.usage is not None:
            print(f"usage: {whole.usage.prompt_tokens} prompt + {whole.usage.completion_tokens} completion tokens")
        show(ddtree_block(whole))

        print("--- streamed")
        block = None
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
            block = ddtree_block(chunk) or block  # on the last chunk
        print()
        show(block)
    except openai.APIConnectionError:
        print(f"error: no server at {args.base_url} (start one with `ddtree serve`)", file=sys.stderr)
        return 1
    except openai.APIStatusError as exc:
        print(f"error: the server answered {exc.status_code}: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
