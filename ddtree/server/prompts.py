"""Prompts to token ids: completions' text or ids, and chat messages through the model's chat template.

These run the tokenizer, so the app calls them off the event loop (`asyncio.to_thread`): a prompt of a
megabyte takes a second or more to tokenise. Token ids, given or made, are checked against `[0, vocab)`.
"""

from __future__ import annotations

from typing import Any

from ddtree.server.card import ApiModel
from ddtree.server.errors import bad_request
from ddtree.server.schemas import ChatMessage, show

SHOWN_IDS = 5


def completion_prompt(model: ApiModel, prompt: str | list[int]) -> list[int]:
    """One prompt: a string, or token ids (`CompletionRequest` has unwrapped a list holding one)."""
    if isinstance(prompt, str):
        return _checked(model, [int(i) for i in model.tokenizer.encode(prompt)], "prompt")
    return _checked(model, list(prompt), "prompt")


def chat_prompt(model: ApiModel, messages: list[ChatMessage]) -> list[int]:
    """The messages through the tokenizer's chat template, with the assistant's turn opened."""
    tokenizer = model.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "the model has no chat template; use /v1/completions with the prompt as text", param="messages"
        )
    try:
        dicts = [m.template_dict() for m in messages]
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    try:
        out: Any = tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # a template may raise on messages it does not take (roles, order)
        raise bad_request(f"the chat template failed on these messages: {exc}", param="messages") from None
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return _checked(model, [int(i) for i in ids], "messages")


def _checked(model: ApiModel, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise bad_request("the prompt has no tokens", param=param)
    bad = [(at, i) for at, i in enumerate(ids) if not 0 <= i < model.vocab_size]
    if bad:
        listed = ", ".join(f"{show(i)} at index {at}" for at, i in bad[:SHOWN_IDS])
        more = f" and {len(bad) - SHOWN_IDS} more" if len(bad) > SHOWN_IDS else ""
        raise bad_request(f"token ids outside the vocabulary [0, {model.vocab_size}): {listed}{more}", param=param)
    return ids
