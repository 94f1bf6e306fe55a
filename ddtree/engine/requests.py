"""What a decode session holds per slot: the request, its output so far, and the rules a request's tokens obey
(its limit, its end-of-sequence tokens, the cache room it needs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()
    request_id: str = ""  # what telemetry calls it; empty: the session makes one up
    trace_parent: str | None = None  # a W3C `traceparent` for the request's span


@dataclass
class RequestOutput:
    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    acceptance_lengths: list[int] = field(default_factory=list)  # per step: accepted drafts + 1
    budgets: list[int] = field(default_factory=list)  # per step: the tree's draft nodes (0: an ar step)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length"


class FirstTokens:
    """The prefill's first tokens of requests that joined together, on their way to the host: `read` waits for
    the copy the first time one of them is needed, so a join never waits for the device."""

    def __init__(self, ticket: Any, wait: Callable[[Any], Any]) -> None:
        self._ticket, self._wait = ticket, wait  # a `Readback` ticket and that reader's `wait`
        self._values: list[int] | None = None

    def read(self, index: int) -> int:
        if self._values is None:
            self._values = [int(t) for t in self._wait(self._ticket)]
        return self._values[index]


@dataclass
class Slot:
    """A slot's occupant."""

    request: Request
    output: RequestOutput
    length: int  # committed tokens in the caches
    first: tuple[FirstTokens, int] | None = None  # the prefill's token, until it has been read: (group, index)

    def take_first(self) -> bool:
        """Give the request its prefill's token if that is still unread; returns whether that finished it."""
        if self.first is None:
            return False
        group, index = self.first
        self.first = None
        emit(self, [group.read(index)])
        return self.output.finished


def emit(entry: Slot, tokens: list[int]) -> None:
    """Append tokens up to the request's limit or its first end-of-sequence token."""
    out, limit, eos = entry.output, entry.request.max_new_tokens, entry.request.eos_token_ids
    for token in tokens:
        if len(out.token_ids) >= limit:
            break
        out.token_ids.append(token)
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
    if not request.prompt:
        raise ValueError("every prompt needs at least one token")
    if request.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
    if request.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {request.temperature}")
    if needed > capacity:
        raise ValueError(
            f"a request needs {needed} cache slots (prompt, new tokens, one tree), the session has {capacity}"
        )
