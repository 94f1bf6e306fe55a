"""Request bodies of the OpenAI-compatible endpoints (pydantic). Unknown fields are ignored.

Defaults, and what is not OpenAI's:

- `temperature`: 1.0, as OpenAI; 0 is greedy; the range is 0..2. `null` means the default.
- `max_tokens`: 16 for `/v1/completions`, as OpenAI; for `/v1/chat/completions` (where `max_completion_tokens`
  is a synonym) the rest of the context, `max_model_len` minus the prompt, as OpenAI and vLLM do.
- `seed`: a random one when absent. With a seed, a request's sampled tokens depend only on its prompt,
  settings and seed, never on the other requests in the batch.
- `stop`: a string or a list of non-empty strings, matched on the text across token boundaries.
- `n`: only 1. `model`: the served model's id (what `/v1/models` lists) or absent; another name is a 404
  (`model_not_found`). Responses name the served model.
- `prompt`: a string or a list of token ids (or a list holding one of these); one prompt per request.
- Accepted and ignored: `top_p`, `presence_penalty`, `frequency_penalty`, `logprobs`, `user`, and any other
  field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"n must be 1 (this server returns one choice per request), got {value}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: the chat template may use them

    role: str
    content: str | list[TextPart] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it, with text parts joined into one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.type != "text" or part.text is None for part in self.content):
                raise ValueError("only text content parts are supported")
            message["content"] = "".join(part.text or "" for part in self.content)
        return message


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def new_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
