"""The chat template and the stop tokens: what turns a user's message into prompt ids, and what ends a reply."""

from __future__ import annotations

from typing import Any

from ddtree.models.target import Target


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt wrapped in the tokenizer's chat template, ready for generation."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(prompt)]


def eos_ids(tokenizer: Any, target: Target) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(target.model, "generation_config", None), target.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))
