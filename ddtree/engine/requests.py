"""What a decode session holds per slot: the request, its output so far, and the rules a request's tokens obey
(its limit, its end-of-sequence tokens, the cache room it needs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddtree.engine.logprobs import LogprobLayout, read_row
from ddtree.settings import check_prompt, check_request_settings

Alternatives = list[tuple[int, float]]  # (token id, log-probability), most probable first


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()
    request_id: str = ""  # what telemetry calls it; empty: the session makes one up
    trace_parent: str | None = None  # a W3C `traceparent` for the request's span
    top_p: float = 1.0  # in (0, 1]: sample from the smallest most-probable set reaching it (1: off)
    top_k: int = 0  # sample from the k most probable tokens (0: off); both filter the T-scaled distribution
    logprobs: int | None = None  # None: none; 0: each emitted token's; N <= MAX_TOP_LOGPROBS: and N alternatives

    @property
    def filtered(self) -> bool:
        """Whether top-p or top-k cuts this request's samples (never at T = 0: greedy is unfiltered)."""
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0)

    def check_settings(self) -> None:
        """SettingsError for a limit or sampling setting out of range (`ddtree.settings.check_request_settings`):
        the server checks each request's body with it, the session each request that joins."""
        check_request_settings(self.max_new_tokens, self.temperature, self.top_p, self.top_k, self.logprobs)


@dataclass
class RequestOutput:
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    # With `Request.logprobs` set, one entry per token of `token_ids`: the target's log-probability of it (raw:
    # log-softmax of its logits, before temperature, top-k, top-p), and the `Request.logprobs` most probable
    # tokens there (an empty list each when it is 0). Both stay empty for a request that asks for none.
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Alternatives] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)  # per step: accepted drafts + 1
    budgets: list[int] = field(default_factory=list)  # per step: the tree's draft nodes (0: an ar step)
    gains: list[float] = field(default_factory=list)  # per adaptive step: its width's predicted gain over ar
    finished: bool = False
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length"


class FirstTokens:
    """The prefill's first tokens of requests that joined together, on their way to the host: `read` waits for
    the copy the first time one of them is needed, so a join never waits for the device. With `layout`, each
    request's row is `[token, log-probability columns (ddtree.engine.logprobs)]`, else the token alone."""

    def __init__(
        self,
        ticket: Any,
        wait: Callable[[Any], Any],
        layout: LogprobLayout | None = None,
        ready: Callable[[Any], bool] | None = None,
    ) -> None:
        self._ticket, self._wait = ticket, wait  # a `Readback` ticket and that reader's `wait`
        self._ready = ready  # and its `ready` (None: read only when needed)
        self._layout = layout
        self._values: np.ndarray | None = None  # [requests] or [requests, 1 + layout.columns] int64

    def ready(self) -> bool:
        """Whether reading them would not wait: read already, or their copy has reached the host."""
        return self._values is not None or (self._ready is not None and self._ready(self._ticket))

    def _rows(self) -> np.ndarray:
        if self._values is None:
            self._values = np.asarray(self._wait(self._ticket), dtype=np.int64)
        return self._values

    def read(self, index: int) -> int:
        values = self._rows()
        return int(values[index] if self._layout is None else values[index, 0])

    def logprobs(self, index: int, top: int) -> tuple[list[float], list[Alternatives]]:
        """The first token's log-probability and its `top` alternatives (the prefill computed them)."""
        assert self._layout is not None, "a prefill computes log-probabilities when a request asks for them"
        return read_row(self._rows()[index, 1:], self._layout, 1, top)


@dataclass
class Slot:
    """A slot's occupant."""

    request: Request
    output: RequestOutput
    length: int  # committed tokens in the caches
    first: tuple[FirstTokens, int] | None = None  # the prefill's token, until it has been read: (group, index)

    def first_arrived(self) -> bool:
        """Whether its prefill's token is still unread but on the host: taking it would not wait."""
        return self.first is not None and self.first[0].ready()

    def take_first(self) -> bool:
        """Give the request its prefill's token if that is still unread; returns whether that finished it."""
        if self.first is None:
            return False
        group, index = self.first
        self.first = None
        top = self.request.logprobs
        emit(self, [group.read(index)], *(() if top is None else group.logprobs(index, top)))
        return self.output.finished


def emit(
    entry: Slot, tokens: list[int], logprobs: list[float] | None = None, top: list[Alternatives] | None = None
) -> None:
    """Append tokens up to the request's limit or its first end-of-sequence token, and with `logprobs` (and
    `top`, one entry per token each) their log-probabilities."""
    out, limit, eos = entry.output, entry.request.max_new_tokens, entry.request.eos_token_ids
    for i, token in enumerate(tokens):
        if len(out.token_ids) >= limit:
            break
        out.token_ids.append(token)
        if logprobs is not None:
            out.logprobs.append(logprobs[i])
            out.top_logprobs.append(top[i] if top is not None else [])
        if token in eos:
            out.finished, out.finish_reason = True, "stop"
            return
    if len(out.token_ids) >= limit:
        out.finished, out.finish_reason = True, "length"


def decoding(entry: Slot | None) -> bool:
    """Whether a slot's occupant still decodes (a request whose first token is unread does)."""
    return entry is not None and not entry.output.finished


def row_bucket(slots: list[Slot | None], num_slots: int) -> int:
    """How many of the first slots a step runs: a power of two past the last slot still decoding (joins take
    the lowest free slots), so few shapes cover every occupancy."""
    last = max((i for i, s in enumerate(slots) if decoding(s)), default=0)
    return min(num_slots, 1 << last.bit_length())


def row_counts(num_slots: int) -> list[int]:
    """Every value `row_bucket` can take: 1, 2, 4, ... and `num_slots`."""
    counts = [1]
    while counts[-1] < num_slots:
        counts.append(min(num_slots, counts[-1] * 2))
    return counts


def group_sizes(n: int, counts: list[int]) -> list[int]:
    """`n` as a sum of `counts` (ascending, starting at 1), taking the largest that fits each time."""
    sizes = []
    while n:
        size = max(c for c in counts if c <= n)
        sizes.append(size)
        n -= size
    return sizes


def round_up(n: int, bucket: int) -> int:
    """`n` rounded up to a multiple of `bucket`: the few shapes that graphs and compiled regions are made for."""
    return -(-n // bucket) * bucket


def cache_tokens(tokens: int, width: int, block: int) -> int:
    """Cache capacity for a request of `tokens` tokens (prompt and new). The last step may commit up to a
    tree's depth past the limit, a step in flight one more, and a finished slot still writes one tree of
    `width` scratch rows. (A request whose prefill token ends it is found out at the first step's read: the
    steps in flight until then commit at most those same two trees.)"""
    return tokens + 3 * width + block


def check_request(request: Request, needed: int, capacity: int) -> None:
    """A request a session can take: a prompt, a limit, sampling within range (SettingsError) and the room."""
    check_prompt(request.prompt)
    request.check_settings()
    if needed > capacity:
        raise ValueError(
            f"a request needs {needed} cache slots (prompt, new tokens, one tree), the session has {capacity}"
        )
