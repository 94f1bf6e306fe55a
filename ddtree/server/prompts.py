"""Prompts to token ids: completions' text or ids, and chat messages through the model's chat template."""

from __future__ import annotations

from typing import Any

from ddtree.server.errors import bad_request
from ddtree.server.model import ServedModel
from ddtree.server.schemas import ChatMessage


def completion_prompt(model: ServedModel, prompt: str | list[int] | list[str] | list[list[int]]) -> list[int]:
    """One prompt: a string or a list of token ids (a list holding one of these is unwrapped)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _checked(model, [int(i) for i in model.tokenizer.encode(prompt)], "prompt")
    ids = [i for i in prompt if isinstance(i, int)]
    if len(ids) != len(prompt):
        raise bad_request("one prompt per request: a string or a list of token ids", param="prompt")
    return _checked(model, ids, "prompt")


def chat_prompt(model: ServedModel, messages: list[ChatMessage]) -> list[int]:
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


def _checked(model: ServedModel, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise bad_request("the prompt has no tokens", param=param)
    bad = [i for i in ids if not 0 <= i < model.vocab_size]
    if bad:
        raise bad_request(f"token ids outside the vocabulary (size {model.vocab_size}): {bad[:5]}", param=param)
    return ids
