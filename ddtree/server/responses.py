"""Response bodies and stream chunks in OpenAI's format, plus the `usage` and `ddtree` blocks.

Every whole response carries `usage` and a `ddtree` block:
`{"method", "budget", "topk", "steps", "mean_acceptance_length", "acceptance_histogram"}`. `budget` and
`topk` are what the engine verifies (`Method.shape`: `ar` 0 and null, `dflash` the drafter's depth and 1;
an unset top-k is null, as in the step logs, and no attribute on spans). `steps` counts decode steps (the
prefill's first token is not a step). `acceptance_histogram` is a list whose entry i counts the steps that
accepted i + 1 tokens (accepted drafts + the bonus), up to the longest seen; `mean_acceptance_length` is
null when there were no steps. Under `--budget auto` the budget follows the load: `budget` is `"auto"`,
`topk` null, and `step_budgets` lists each step's draft nodes (0: an `ar` step). Under `--budget adaptive`
each step chooses its width: `budget` is `"adaptive"`, `max_budget` the widest tree a step may verify,
`step_budgets` each step's width and `step_gains` the tokens per second each step's width predicted over an
`ar` step's.

Streams: text chunks, then a chunk with the finish reason; with `stream_options.include_usage` one more
chunk with empty `choices` and `usage` (as OpenAI). The `ddtree` block rides on the last chunk before
`data: [DONE]`: the usage chunk when there is one, else the finish chunk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from ddtree.adaptive import ADAPTIVE  # the budget of a server whose steps choose their width
from ddtree.methods import mean_acceptance_length

DONE = "data: [DONE]\n\n"
AUTO = "auto"  # the budget of a server whose budget follows the load


def ddtree_block(
    method: str,
    budget: int,
    topk: int | None,
    lengths: list[int],
    step_budgets: list[int] | None = None,
    step_gains: list[float] | None = None,
) -> dict[str, Any]:
    """The block; `step_budgets` (each step's budget) where the budget follows the load, and `step_gains` too
    where each step chooses its width (`budget` is then the widest)."""
    histogram = [0] * max(lengths, default=0)
    for length in lengths:
        histogram[length - 1] += 1
    adaptive, switching = step_gains is not None, step_budgets is not None
    block: dict[str, Any] = {
        "method": method,
        "budget": ADAPTIVE if adaptive else AUTO if switching else budget,
        "topk": topk if adaptive or not switching else None,
        "steps": len(lengths),
        "mean_acceptance_length": mean_acceptance_length(lengths),
        "acceptance_histogram": histogram,
    }
    if step_gains is not None:
        block["max_budget"] = budget
        block["step_gains"] = [round(g, 4) for g in step_gains]
    if step_budgets is not None:
        block["step_budgets"] = step_budgets
    return block


def usage_block(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


_JSON = msgspec.json.Encoder()


def sse(payload: dict[str, Any]) -> str:
    """One SSE event. msgspec encodes a chunk in a tenth of `json.dumps`'s time (non-ASCII text as UTF-8, not
    escaped); a string no UTF-8 can hold (a lone surrogate, from a name given on the command line) takes
    `json.dumps`'s escapes."""
    try:
        data = _JSON.encode(payload).decode()
    except UnicodeEncodeError:
        data = json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass(frozen=True)
class Reply:
    """What every response and chunk of one request shares."""

    id: str
    created: int
    model: str
    chat: bool
    include_usage: bool = False

    def body(
        self,
        text: str,
        finish_reason: str,
        usage: dict[str, int],
        ddtree: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [choice], "usage": usage, "ddtree": ddtree}

    def opening(self) -> list[str]:
        """Chat streams open with the assistant's role, as OpenAI's do."""
        return [sse(self._chunk({"role": "assistant", "content": ""}, None))] if self.chat else []

    def piece(self, text: str, logprobs: dict[str, Any] | None = None) -> str:
        return sse(self._chunk({"content": text} if self.chat else text, None, logprobs))

    def ending(self, finish_reason: str, usage: dict[str, int], ddtree: dict[str, Any]) -> list[str]:
        finish = self._chunk({} if self.chat else "", finish_reason)
        if not self.include_usage:
            return [sse({**finish, "ddtree": ddtree}), DONE]
        tail = {**self._head(self._chunk_kind()), "choices": [], "usage": usage, "ddtree": ddtree}
        return [sse(finish), sse(tail), DONE]

    def _chunk(
        self, delta: dict[str, str] | str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        chunk = {**self._head(self._chunk_kind()), "choices": [choice]}
        return {**chunk, "usage": None} if self.include_usage else chunk

    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}
