"""One request on the handler's side: submit a job to the engine and turn its updates into text.

The engine's updates reach an asyncio queue of the request's own: from the engine client's reader task (an
engine in another process) directly, from a decode thread in this process through
`loop.call_soon_threadsafe`; the handler awaits them and never blocks the engine. A stop string that
matches, a client that went away, or a handler that ends for any other reason cancels the job (`close`),
which frees its slot at the next step boundary. Each update taken is metered (`ddtree.server.metrics`): the
first token, the tokens and the steps' acceptance lengths and budgets, on the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from ddtree.engine.requests import Request
from ddtree.server.link import EngineLink
from ddtree.server.logprobs import LogprobFormatter
from ddtree.server.metrics import RequestMeter
from ddtree.server.text import TextStream
from ddtree.server.worker import REJECTED_QUEUE_FULL, Job, QueueFull, Scored, Update, WorkerStopped

CLIENT_GONE = "the client disconnected"


class GenerationFailed(Exception):
    """The decode thread failed this request."""


class ClientGone(Exception):
    """The client disconnected before the response was sent."""


class Generation:
    def __init__(
        self, worker: EngineLink, request: Request, text: TextStream, meter: RequestMeter, stream_interval: int = 1
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._interval = stream_interval  # tokens gathered per piece of text (the last piece may have fewer)
        self._updates: asyncio.Queue[Update] = asyncio.Queue()
        self._worker = worker
        self._text = text
        self.meter = meter
        self._pending: Update | None = None
        self._queued_tokens = 0  # in `_updates`: their tokens, and how many of them end the request
        self._queued_ends = 0
        self.job = Job(request, self._post)
        self.acceptance_lengths: list[int] = []
        self.step_budgets: list[int] = []
        self.step_gains: list[float] = []  # an adaptive server's: per step, the gain its width predicted
        self.scored: list[tuple[int, Scored]] = []  # per token kept, with logprobs asked for: (id, its scores)
        self.unsent = 0  # of `scored`, the last ones no chunk has carried yet
        self.formatter: LogprobFormatter | None = None  # set where the request asked for logprobs
        self.finish_reason: str | None = None
        self.failed = False  # the decode thread failed it

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.request.prompt)

    @property
    def completion_tokens(self) -> int:
        return self._text.tokens

    def submit(self) -> None:
        """Queue the job (QueueFull, WorkerStopped)."""
        self._worker.submit(self.job)

    async def started(self) -> None:
        """Wait for the first update, the prefill's token (GenerationFailed, ClientGone; QueueFull and
        WorkerStopped where an engine in another process refused the job). A pipelined session hands it over at
        the end of the first step after the join whose end finds its copy on the host."""
        self._pending = await self._next_update()

    async def next_text(self) -> str | None:
        """The next piece of text (maybe empty): the updates of `stream_interval` tokens or more (one update
        at 1: a piece per step), or the last ones; None once the request has ended."""
        if self.finish_reason is not None:
            return None
        update, self._pending = self._pending or await self._next_update(), None
        start = self._text.tokens
        text = self._take(update)
        while self.finish_reason is None and self._text.tokens - start < self._interval:
            text += self._take(await self._next_update())
        return text

    def ready(self) -> bool:
        """`next_text` would return without waiting: the updates already here complete a piece or end the
        request. The stream writes what it has only when this is False, so that a handler behind its engine
        sends the steps it caught up on in one write (one SSE event each still)."""
        if self.finish_reason is not None or self._queued_ends:
            return True
        pending = len(self._pending.token_ids) if self._pending is not None else 0
        return pending + self._queued_tokens >= self._interval

    def take_unsent(self) -> list[tuple[int, Scored]]:
        """The scored tokens that no stream chunk has carried yet (for the next one)."""
        unsent = self.scored[len(self.scored) - self.unsent :] if self.unsent else []
        self.unsent = 0
        return unsent

    async def text(self) -> str:
        pieces = []
        while (piece := await self.next_text()) is not None:
            pieces.append(piece)
        return "".join(pieces)

    def abandon(self) -> None:
        """The client went away: cancel the job and wake whoever waits on it."""
        self._worker.cancel(self.job)
        self._put(Update([], [], error=CLIENT_GONE))

    def close(self) -> None:
        """Cancel the job unless it is over (idempotent): its slot is freed at the next step boundary."""
        self._worker.cancel(self.job, self.finish_reason or "cancelled")

    def _post(self, update: Update) -> None:
        """Hand the update to the handler; never waits. From a decode thread in this process, through the
        event loop's thread-safe call; from the engine client's reader, already on the loop, directly."""
        if threading.get_ident() == self._loop_thread:
            self._put(update)
        else:
            self._loop.call_soon_threadsafe(self._put, update)

    def _put(self, update: Update) -> None:
        """On the loop: queue the update and count what `ready` reads."""
        self._queued_tokens += len(update.token_ids)
        self._queued_ends += _ends(update)
        self._updates.put_nowait(update)

    async def _next_update(self) -> Update:
        update = await self._updates.get()
        self._queued_tokens -= len(update.token_ids)
        self._queued_ends -= _ends(update)
        if update.rejected is not None:
            raise (QueueFull if update.rejected == REJECTED_QUEUE_FULL else WorkerStopped)(update.error)
        if update.error == CLIENT_GONE:
            raise ClientGone(update.error)
        if update.error is not None:
            self.failed = True
            raise GenerationFailed(update.error)
        return update

    def _take(self, update: Update) -> str:
        before = self._text.tokens
        if update.token_ids and before == 0:
            self.meter.first_token(self.prompt_tokens)
        self.acceptance_lengths += update.acceptance_lengths
        self.step_budgets += update.budgets
        self.step_gains += update.gains
        text = self._text.feed(update.token_ids)
        kept = self._text.tokens - before  # a stop string drops the tokens after the one that completed it
        if update.scores:
            self.scored += zip(update.token_ids[:kept], update.scores[:kept], strict=True)
            self.unsent += kept
        self.meter.took(kept, update.acceptance_lengths, update.budgets)
        if self._text.stopped:
            self.finish_reason = "stop"
            self.close()
        elif update.finish_reason is not None:
            self.finish_reason = update.finish_reason
            text += self._text.finish()
        return text


def _ends(update: Update) -> bool:
    return update.finish_reason is not None or update.error is not None or update.rejected is not None


@asynccontextmanager
async def abandon_on_disconnect(receive: Callable[[], Any], generation: Generation) -> AsyncIterator[None]:
    """While the handler waits (before any response is sent), a disconnect abandons the generation."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        generation.abandon()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
