"""The `logprobs` of a choice, in OpenAI's two formats, from the engine's per-token scores.

The values are the target's own log-probabilities of each emitted token (its raw logits' log-softmax, before
temperature, top-k or top-p, as vLLM reports by default) and of the most probable tokens at that position.
A token's text is its own decode (`tokenizer.decode([id])`, special tokens included).

- Completions (`logprobs: N`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; each
  `top_logprobs` entry maps the N most probable tokens' texts to their values, and the chosen token's too when
  it is not among them (so N + 1 entries at most, as OpenAI's). `text_offset` counts characters of the
  completion's text from its start (the prompt is not echoed).
- Chat (`logprobs: true, top_logprobs: N`): `{"content": [{"token", "logprob", "bytes", "top_logprobs":
  [N x {"token", "logprob", "bytes"}]}], "refusal": null}`.

A stream's chunks carry the tokens they complete; the offsets run on across chunks.
"""

from __future__ import annotations

from typing import Any

from ddtree.server.worker import Scored


class LogprobFormatter:
    """Builds one request's `logprobs` objects; `top` alternatives per token."""

    def __init__(self, tokenizer: Any, chat: bool, top: int) -> None:
        self.tokenizer, self.chat, self.top = tokenizer, chat, top
        self.offset = 0  # characters of the completion's text before the next token

    def block(self, scored: list[tuple[int, Scored]]) -> dict[str, Any]:
        return self._chat(scored) if self.chat else self._completion(scored)

    def _text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def _completion(self, scored: list[tuple[int, Scored]]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for token, (value, alternatives) in scored:
            text = self._text(token)
            top = {self._text(i): v for i, v in alternatives[: self.top]}
            top.setdefault(text, value)
            tokens.append(text)
            values.append(value)
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _chat(self, scored: list[tuple[int, Scored]]) -> dict[str, Any]:
        content = [
            {**self._entry(token, value), "top_logprobs": [self._entry(i, v) for i, v in alternatives[: self.top]]}
            for token, (value, alternatives) in scored
        ]
        return {"content": content, "refusal": None}

    def _entry(self, token: int, value: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
