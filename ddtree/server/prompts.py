"""Prompts to token ids: completions' text or ids, and chat messages through the model's chat template.

These run the tokenizer, so the app calls them off the event loop (`asyncio.to_thread`): a prompt of a
megabyte takes a second or more to tokenise. Token ids, given or made, are checked against `[0, vocab)`.
"""

from __future__ import annotations

from typing import Any

from ddtree.errors import SettingsError
from ddtree.server.card import ApiModel
from ddtree.server.errors import bad_request
from ddtree.server.schemas import ChatMessage
from ddtree.settings import check_prompt


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
    """The ids, if `ddtree.settings.check_prompt` takes them; else a 400 naming `param`."""
    try:
        check_prompt(ids, model.vocab_size)
    except SettingsError as exc:
        raise bad_request(f"the prompt {exc.problem}", param=param) from None
    return ids
