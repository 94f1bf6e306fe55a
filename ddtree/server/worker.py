"""The decode thread: one thread owns the `DecodeSession`; HTTP handlers reach it through a bounded queue.

- `submit` puts a job in the waiting queue (at most `max_queue` jobs; `QueueFull` beyond) and returns at
  once. The job's `deliver` callback is how the thread hands back `Update`s; the app's callback posts them
  to the request's asyncio queue with `loop.call_soon_threadsafe`, so the thread never waits on a handler.
  `submit` stamps the job's `queued_at`, and the thread its `joined_at` as it takes the job into a slot
  (before the prefill): the handler's queue time; and its `first_at` as it hands over the first token: the
  prefill's time, up to the step whose readback carried it.
- Between steps the thread leaves cancelled slots, joins waiting jobs into free slots (continuous batching:
  a request that arrives mid-generation joins at the next step boundary), steps while a slot is active,
  delivers each request its new tokens and acceptance lengths, and leaves finished slots. `delivered` runs
  after each round of deliveries: after each step, and after a join whose first tokens were read at once (a
  session without pipelining), so that those reach the handlers without waiting for the next step. With
  nothing to do it waits on a condition variable: no busy loop.
- `cancel` (a client that went away, a stop string that matched) takes a job out of the queue, or marks it
  so that its slot is left at the next step boundary.
- A failed join fails the joining requests; a failed step fails every request in the session, which is
  then rebuilt. If even that fails, the thread ends: `alive` turns false and every job left gets an error.

Nothing here logs token ids or text.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession

log = logging.getLogger(__name__)

STEP_FAILED = "the decode step failed"
JOIN_FAILED = "the prefill failed"
STOPPED = "the decode loop stopped"
REJECTED_QUEUE_FULL = "queue_full"  # Update.rejected: the queue was full (QueueFull)
REJECTED_STOPPED = "stopped"  # Update.rejected: the decode loop was not running (WorkerStopped)


class QueueFull(Exception):
    """`max_queue` requests are already waiting for a slot."""


class WorkerStopped(Exception):
    """The decode thread is not running."""


Scored = tuple[float, list[tuple[int, float]]]  # a token's log-probability and its top alternatives


@dataclass(frozen=True)
class Update:
    """What a request got since its last update. The last one has a finish reason or an error."""

    token_ids: list[int]
    acceptance_lengths: list[int]  # per decode step: accepted drafts + 1
    budgets: list[int] = field(default_factory=list)  # per decode step: the tree's draft nodes
    scores: list[Scored] = field(default_factory=list)  # per token, where the request asked for logprobs
    finish_reason: str | None = None  # "stop" (an end-of-sequence token) or "length"
    error: str | None = None  # the request failed; nothing follows
    rejected: str | None = None  # the request never got a place (REJECTED_*), said by an engine in another process
    gains: list[float] = field(default_factory=list)  # per adaptive decode step: its predicted gain over ar


@dataclass(eq=False)
class Job:
    request: Request
    deliver: Callable[[Update], None]  # called on the decode thread; must not block
    cancelled: bool = False
    cancel_reason: str = "cancelled"  # the finish reason telemetry reports when it leaves early ("stop": a stop string)
    queued_at: float | None = None  # perf_counter time of `submit`
    joined_at: float | None = None  # perf_counter time the decode thread took it into a slot
    first_at: float | None = None  # perf_counter time the decode thread handed over its first token


@dataclass
class _Running:
    job: Job
    tokens: int = 0  # tokens delivered so far
    steps: int = 0  # acceptance lengths delivered so far


StepHook = Callable[[int, int], None]  # (steps so far, occupied slots), on the decode thread after each step


class DecodeWorker:
    def __init__(self, make_session: Callable[[], DecodeSession], max_queue: int) -> None:
        self._make_session = make_session
        self._max_queue = max_queue
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: dict[int, _Running] = {}  # slot -> its request
        self._thread: threading.Thread | None = None
        self._alive = False
        self._stopping = False
        self._paused = False
        self.session: DecodeSession | None = None
        self.step_hook: StepHook | None = None  # for tests: runs after every step
        # Runs on the decode thread after each round of deliveries (a join's and a step's, a failure's, the
        # last ones at the end): the engine process sends a round's updates as one message per API process.
        self.delivered: Callable[[], None] | None = None
        self.steps = 0
        self.cancelled = 0  # requests left before their end
        self.failures = 0  # failed joins and steps

    # -- any thread ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Build the session here (an error surfaces to the caller), then start the thread."""
        self.session = self._make_session()
        self._alive, self._stopping = True, False
        self._thread = threading.Thread(target=self._run, name="ddtree-decode", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._alive and self._thread is not None and self._thread.is_alive()

    def submit(self, job: Job) -> None:
        with self._cond:
            if not self.alive or self._stopping:
                raise WorkerStopped(STOPPED)
            if len(self._waiting) >= self._max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting for a slot")
            job.queued_at = time.perf_counter()
            self._waiting.append(job)
            self._cond.notify_all()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Drop a waiting job, or have its slot left at the next step boundary. Idempotent."""
        with self._cond:
            if not job.cancelled:
                job.cancel_reason = reason
            job.cancelled = True
            if job in self._waiting:
                self._waiting.remove(job)
            self._cond.notify_all()

    def pause(self) -> None:
        """Stop taking jobs and stepping at the next step boundary (for tests and maintenance)."""
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def slots(self) -> int:
        """The session's slots (0 before `start`)."""
        session = self.session
        return session.num_slots if session is not None else 0

    # -- the decode thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (batch := self._next_batch()) is not None:
                self._leave_cancelled()
                if self._join(batch):
                    self._flush()  # first tokens read at the join go out now, not after the next step
                if self._running:
                    self._step()
                if not self._running:
                    self._idle()
                self._flush()
        except BaseException:
            log.exception("the decode loop stopped")
        finally:
            self._shut_down()
            self._flush()

    def _flush(self) -> None:
        if self.delivered is not None:
            self.delivered()

    def _next_batch(self) -> list[Job] | None:
        """Wait until there is work; take as many waiting jobs as there are free slots. None: stop."""
        with self._cond:
            while not self._stopping and (self._paused or not (self._running or self._waiting)):
                self._cond.wait()
            if self._stopping:
                return None
            free = self._session().num_slots - len(self._running)
            return [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]

    def _session(self) -> DecodeSession:
        if self.session is None:
            raise RuntimeError("the worker has no session; call start() first")
        return self.session

    def _leave_cancelled(self) -> None:
        session = self._session()
        for slot, run in list(self._running.items()):
            if run.job.cancelled:
                session.leave(slot, run.job.cancel_reason)
                self._forget(slot)
                self.cancelled += 1

    def _join(self, jobs: list[Job]) -> bool:
        """Take `jobs` into slots (a prefill); True where some joined and their first tokens were read at
        once (a session without pipelining), to be delivered before the next step."""
        jobs = [j for j in jobs if not j.cancelled]
        if not jobs:
            return False
        joined = time.perf_counter()
        for job in jobs:
            job.joined_at = joined
        try:
            slots = self._session().join([j.request for j in jobs])
        except Exception as exc:  # the session's slots are untouched: the others decode on
            log.error("a join of %d requests failed: %s", len(jobs), type(exc).__name__)
            self.failures += 1
            for job in jobs:
                _send(job, Update([], [], error=JOIN_FAILED))
            return True
        with self._cond:
            self._running.update({slot: _Running(job) for slot, job in zip(slots, jobs, strict=True)})
        self._publish()  # the prefill's first tokens where the session read them at once (not pipelined)
        return self._session().pipeline_depth == 1

    def _step(self) -> None:
        try:
            self._session().step()
        except Exception:
            log.exception("a decode step failed; failing %d requests, rebuilding the session", len(self._running))
            self._fail_running(STEP_FAILED)
            self.session = self._make_session()
            return
        self.steps += 1
        self._publish()
        if self.step_hook is not None:
            self.step_hook(self.steps, len(self._running))

    def _idle(self) -> None:
        """Finish any step still in flight (pipelined sessions), so that none is left behind while idle."""
        try:
            self._session().drain()
        except Exception:
            log.exception("finishing the steps in flight failed; rebuilding the session")
            self.failures += 1
            self.session = self._make_session()

    def _publish(self) -> None:
        """Deliver each running request what it got since its last update; leave the finished ones."""
        session = self._session()
        for slot, run in list(self._running.items()):
            out = session.output(slot)
            tokens, lengths = out.token_ids[run.tokens :], out.acceptance_lengths[run.steps :]
            budgets, gains = out.budgets[run.steps :], out.gains[run.steps :]
            scores = list(zip(out.logprobs[run.tokens :], out.top_logprobs[run.tokens :], strict=True))
            run.tokens, run.steps = len(out.token_ids), len(out.acceptance_lengths)
            if tokens and run.job.first_at is None:
                run.job.first_at = time.perf_counter()
            if out.finished:
                session.leave(slot)
                self._forget(slot)
                reason = out.finish_reason or "length"
                _send(run.job, Update(tokens, lengths, budgets, scores, finish_reason=reason, gains=gains))
            elif tokens or lengths:
                _send(run.job, Update(tokens, lengths, budgets, scores, gains=gains))

    def _forget(self, slot: int) -> None:
        with self._cond:
            del self._running[slot]

    def _fail_running(self, message: str) -> None:
        self.failures += 1
        with self._cond:
            jobs = [run.job for run in self._running.values()]
            self._running.clear()
        for job in jobs:
            _send(job, Update([], [], error=message))

    def _shut_down(self) -> None:
        with self._cond:
            self._alive = False
            jobs = [*self._waiting, *(run.job for run in self._running.values())]
            self._waiting.clear()
            self._running.clear()
        for job in jobs:
            _send(job, Update([], [], error=STOPPED))


def _send(job: Job, update: Update) -> None:
    if job.cancelled:
        return
    try:
        job.deliver(update)
    except Exception as exc:  # e.g. the handler's event loop has closed: nobody is listening
        log.warning("an update could not be delivered: %s", type(exc).__name__)
        job.cancelled = True
