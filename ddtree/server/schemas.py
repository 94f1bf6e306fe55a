"""Request bodies of the OpenAI-compatible endpoints (pydantic). No field is silently ignored: a field this
server does not know is a 400 naming it, and a known one it does not implement is a 400 unless its value is
the one that changes nothing (`NEUTRAL`).

Defaults, and what is not OpenAI's:

- `temperature`: 1.0, as OpenAI; 0 is greedy; the range is 0..2. `null` means the default.
- `max_tokens`: 16 for `/v1/completions`, as OpenAI; for `/v1/chat/completions` (where `max_completion_tokens`
  is a synonym) the rest of the context, `max_model_len` minus the prompt, as OpenAI and vLLM do.
- `seed`: a random one when absent. With a seed, a request's sampled tokens depend only on its prompt,
  settings and seed, never on the other requests in the batch.
- `stop`: a string or a list of up to `MAX_STOPS` non-empty strings of up to `MAX_STOP_CHARS` characters
  each, matched on the text across token boundaries (the bounds keep the matching cheap per token).
- `n`: only 1. `model`: the served model's id (what `/v1/models` lists) or absent; another name is a 404
  (`model_not_found`). Responses name the served model.
- `prompt`: a string or a list of token ids (or a list holding one of these); one prompt per request. Token
  ids are JSON integers (not booleans or floats); their range is checked against the vocabulary later
  (`ddtree.server.prompts`), where its size is known.
- Text: no string anywhere in a body (prompt, messages and their extra fields, stop, model) may hold a lone
  surrogate (`"\ud800"` is valid JSON but not encodable as UTF-8) or a NUL character: `text_problem` finds
  the first such string, and the app answers 400 naming where it is and the character.
- `top_p` (0 < p <= 1, default 1) and `top_k` (vLLM's extension; 0 or -1 = off, the default): the target's
  distribution at `temperature` is cut to its top-k tokens, then to the smallest set reaching p; at
  temperature 0 (greedy) they change nothing.
- `logprobs`: on completions an integer 0..`MAX_LOGPROBS` (the emitted tokens' log-probabilities and that many
  alternatives); on chat a boolean, with `top_logprobs` 0..`MAX_LOGPROBS`. They are the target's own
  log-probabilities (its raw logits, before temperature and filtering), as vLLM reports by default.
- `user`: accepted; it names the end user to the caller's own records and changes nothing here.
- Refused unless neutral: `presence_penalty` and `frequency_penalty` (0), `logit_bias` (empty), `best_of`
  (1), `echo` (false), `suffix` (empty), `repetition_penalty` (1): not implemented, so a request that needs
  them gets a 400 that names them rather than output that ignores them.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ddtree.settings import MAX_TOP_LOGPROBS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = MAX_TOP_LOGPROBS  # alternatives per token, as OpenAI's chat API allows
NEUTRAL: dict[str, Any] = {  # known, not implemented: accepted only with the value that changes nothing
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": {},
    "best_of": 1,
    "echo": False,
    "suffix": "",
}
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
SHOWN_CHARS = 24  # of a bad value quoted in an error message
ONE_PROMPT = "one prompt per request: a string or a list of token ids"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _neutral(self) -> Sampling:
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name, None)
            if value is not None and value != neutral:
                raise ValueError(
                    f"{name} is not supported by this server (only {show(neutral)} or leaving it out); "
                    f"got {show(value)}"
                )
        return self

    def logprobs_count(self) -> int | None:
        """None: no log-probabilities; else how many alternatives per token besides the chosen one (each
        endpoint spells it its own way)."""
        return None

    def top_k_value(self) -> int:
        """The top-k to sample with: 0 (off) for absent, 0 and -1."""
        return max(self.top_k or 0, 0)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"n must be 1 (this server returns one choice per request), got {show(value)}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        longest = max(stops, key=len, default="")
        if len(longest) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings are at most {MAX_STOP_CHARS} characters, got one of {len(longest)}")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def text_problem(self) -> tuple[str, str] | None:
        """The first string of the body that cannot go on to the tokenizer: (its top field, the message)."""
        return text_problem(self)


class CompletionRequest(Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def logprobs_count(self) -> int | None:
        """None: no log-probabilities; else how many alternatives per token besides the chosen one."""
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        """A list holding one prompt is unwrapped; a list of ids must hold JSON integers only."""
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if not isinstance(value, list):
            return value  # a string, or something the field's own validation refuses
        for index, item in enumerate(value):
            if isinstance(item, str | list):
                raise ValueError(ONE_PROMPT)
            if isinstance(item, bool) or not isinstance(item, int):
                raise ValueError(f"token ids are integers; got {show(item)} at index {index}")
        return value


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
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_count(self) -> int | None:
        """None: no log-probabilities; else how many alternatives per token besides the chosen one."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def new_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


def show(value: Any) -> str:
    """A value as JSON would write it, cut short, and ASCII only (so that the error message always encodes)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = type(value).__name__
    return _cut(text)


def text_problem(body: BaseModel) -> tuple[str, str] | None:
    """The first string in `body` (fields, extra fields, nested lists and objects, keys too) that holds a lone
    surrogate or a NUL character: (the top-level field, a message naming the path and the character)."""
    stack: list[tuple[str, str, Any]] = [(name, name, value) for name, value in reversed(_items(body))]
    while stack:  # depth first, in document order; no recursion, however deep the JSON
        top, path, value = stack.pop()
        if isinstance(value, str):
            problem = _char_problem(value)
            if problem is not None:
                return top, f"{path}: the string holds {problem}"
        elif isinstance(value, BaseModel | dict):
            items = _items(value) if isinstance(value, BaseModel) else [(str(k), v) for k, v in value.items()]
            keys = [(top, f"{path} (a key)", key) for key, _ in items]
            values = [(top, f"{path}.{_cut(key)}", item) for key, item in items]  # keys are checked first
            stack += reversed([*keys, *values])
        elif isinstance(value, list):
            stack += reversed([(top, f"{path}[{i}]", item) for i, item in enumerate(value)])
    return None


def _cut(text: str) -> str:
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}..."


def _items(model: BaseModel) -> list[tuple[str, Any]]:
    fields = [(name, getattr(model, name)) for name in type(model).model_fields]
    return fields + list((model.model_extra or {}).items())


def _char_problem(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate {text[exc.start]!a} at character {exc.start}, which UTF-8 cannot encode"
    at = text.find("\x00")
    return f"a NUL character ({chr(0)!a}) at character {at}" if at >= 0 else None
