"""Token ids to text, piece by piece, and stop strings matched on that text across token boundaries.

- `Detokenizer` decodes a window of recent ids twice, with and without the newest ones, and releases the
  difference once it no longer ends in U+FFFD: a character split over several tokens (bytes of one UTF-8
  character) is released whole. The window starts with the prompt's last few ids, so that a tokenizer that
  drops a leading space from the first token of a decode gets it right. Special tokens (end of sequence) are
  skipped. A fast tokenizer's decode runs in its Rust backend directly (what `decode` does, less transformers'
  per-call argument handling: a third of the time, on every stream's every step).
- `StopMatcher` holds back the longest tail of the text that could still begin a stop string and releases
  the rest; when a stop string appears, the text before its earliest occurrence is released and nothing
  after. The stop string itself is never returned.
- `TextStream` feeds tokens one at a time when there are stop strings, so that it knows the token that
  completed the match: `tokens` counts the tokens up to and including it.
"""

from __future__ import annotations

from typing import Any

PROMPT_CONTEXT = 5  # prompt ids that open the decode window
REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any, context: list[int]) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's `tokenizers.Tokenizer`
        self._ids = list(context)
        self._prefix = 0  # the window starts here
        self._read = len(self._ids)  # text of ids before this has been released

    def push(self, ids: list[int]) -> str:
        """The text that `ids` complete; may be empty while a character is still partial."""
        self._ids.extend(ids)
        before, after = self._decode(self._prefix, self._read), self._decode(self._prefix, len(self._ids))
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is left, partial characters included (as U+FFFD)."""
        before, after = self._decode(self._prefix, self._read), self._decode(self._prefix, len(self._ids))
        self._prefix = self._read = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""

    def _decode(self, start: int, end: int) -> str:
        if self._backend is not None:
            return str(self._backend.decode(self._ids[start:end], skip_special_tokens=True))
        return str(
            self._tokenizer.decode(self._ids[start:end], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        )


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = stops
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The text that is safe to release; once a stop string matched, `stopped` is set and all ends."""
        if self.stopped:
            return ""
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buffer[: min(hits)]
        keep = self._partial(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The held-back text, at the end of generation."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self._stops), default=1) - 1
        for size in range(min(longest, len(text)), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self._stops):
                return size
        return 0


class TextStream:
    """One request's output text: detokenized, cut at the first stop string."""

    def __init__(self, tokenizer: Any, prompt: list[int], stops: list[str]) -> None:
        self._detokenizer = Detokenizer(tokenizer, prompt[-PROMPT_CONTEXT:])
        self._matcher = StopMatcher(stops)
        self._by_token = bool(stops)
        self.tokens = 0  # tokens consumed (after a stop string, the rest are dropped)

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    def feed(self, ids: list[int]) -> str:
        if not self._by_token:
            self.tokens += len(ids)
            return self._matcher.push(self._detokenizer.push(ids))
        pieces = []
        for token in ids:
            if self.stopped:
                break
            self.tokens += 1
            pieces.append(self._matcher.push(self._detokenizer.push([token])))
        return "".join(pieces)

    def finish(self) -> str:
        """The rest of the text at the end of generation."""
        if self.stopped:
            return ""
        text = self._matcher.push(self._detokenizer.flush())
        return text + self._matcher.flush()
