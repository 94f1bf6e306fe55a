"""The API process's side of the engine: what the app's handlers call in place of an in-process decode thread.

`EngineClient` has the decode thread's surface (`submit`, `cancel`, `alive`, `waiting`, `running`, `slots`)
over the engine process's sockets (`ddtree.server.transport`). It lives on the event loop: one task reads the
inbox and hands each request its update; sends never wait. A full queue or a stopped engine comes back as a
rejected update (`Update.rejected`), which the handler turns into 429 or 503 before any response starts.
When the launcher says the engine died, every open request fails at once and `alive` turns false.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ddtree.server import transport as tp
from ddtree.server.worker import STOPPED, Job, Update, WorkerStopped

log = logging.getLogger(__name__)

ENGINE_DIED = "the engine process died"
WATCH_EVERY = 0.5  # seconds between checks that the launcher is still there


class EngineClient:
    def __init__(self, plan: tp.Plan, index: int) -> None:
        self.plan = plan
        self.index = index
        self._numbers = itertools.count()
        self._jobs: dict[int, Job] = {}
        self._rids: dict[int, int] = {}  # id(job) -> its number
        self._status = tp.Status(alive=False)
        self._dead = False
        self._context: zmq.asyncio.Context | None = None
        self._push: zmq.Socket[Any] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.on_parent_gone: Any = None  # called once the launcher is gone (the app shuts down)

    async def open(self) -> None:
        """Bind this process's inbox, connect to the engine's, start reading."""
        self._context = zmq.asyncio.Context()
        inbox = self._context.socket(zmq.PULL)
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.bind(self.plan.api_inbox(self.index))
        self._push = tp.push(self._context, self.plan.engine_inbox)
        self._status = tp.Status(alive=True)
        self._tasks = [asyncio.create_task(self._read(inbox)), asyncio.create_task(self._watch())]

    async def close(self, timeout: float = 0.0) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None
        self._fail_all(STOPPED)

    @property
    def alive(self) -> bool:
        return not self._dead and self._push is not None and self._status.alive

    def waiting(self) -> int:
        return self._status.waiting

    def running(self) -> int:
        return self._status.running

    def slots(self) -> int:
        return self._status.slots

    def dropped(self) -> dict[str, int]:
        return dict(self._status.dropped)

    def submit(self, job: Job) -> None:
        """Send the job (WorkerStopped where the engine is gone); a full queue answers later, as `rejected`."""
        if not self.alive or self._push is None:
            raise WorkerStopped(ENGINE_DIED if self._dead else STOPPED)
        rid = next(self._numbers)
        self._jobs[rid], self._rids[id(job)] = job, rid
        if not tp.try_send(self._push, tp.Submit(self.index, rid, job.request)):
            self._forget(rid)
            raise WorkerStopped("the engine does not take requests")

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Stop hearing of the job; the engine frees its slot at its next step boundary. Idempotent."""
        if not job.cancelled:
            job.cancel_reason = reason
        job.cancelled = True
        rid = self._rids.get(id(job))
        if rid is None:
            return
        self._forget(rid)
        if self._push is not None:
            tp.try_send(self._push, tp.Cancel(self.index, rid, reason))

    # -- the event loop's tasks ---------------------------------------------------------------------------

    async def _read(self, inbox: zmq.asyncio.Socket) -> None:
        while True:
            data = await inbox.recv()
            try:
                message = tp.decode_for_api(data)
            except msgspec.DecodeError as exc:
                log.error("a message that is not ours reached API process %d: %s", self.index, exc)
                continue
            self._take(message)

    def _take(self, message: tp.ToApi) -> None:
        if isinstance(message, tp.Outputs):
            self._status = message.status
            for out in message.outs:
                self._deliver(out)
        elif isinstance(message, tp.Rejected):
            self._status = message.status
            job = self._forget(message.rid)
            if job is not None:
                job.deliver(Update([], [], error=message.message, rejected=message.reason))
        elif isinstance(message, tp.Status):
            self._status = message
        else:
            self._dead = True
            self._fail_all(message.message)

    def _deliver(self, out: tp.Out) -> None:
        job = self._jobs.get(out.rid)
        if job is None or job.cancelled:
            return
        if out.queue_seconds is not None:  # the engine's queue and prefill times, in the handler's terms
            job.queued_at, job.joined_at = 0.0, out.queue_seconds
        if out.prefill_seconds is not None and job.joined_at is not None:
            job.first_at = job.joined_at + out.prefill_seconds
        if out.finish_reason is not None or out.error is not None:
            self._forget(out.rid)
        job.deliver(
            Update(
                out.token_ids,
                out.acceptance_lengths,
                out.budgets,
                out.scores,
                out.finish_reason,
                out.error,
                gains=out.gains,
            )
        )

    def _forget(self, rid: int) -> Job | None:
        job = self._jobs.pop(rid, None)
        if job is not None:
            self._rids.pop(id(job), None)
        return job

    def _fail_all(self, message: str) -> None:
        jobs = list(self._jobs.values())
        self._jobs.clear()
        self._rids.clear()
        for job in jobs:
            if not job.cancelled:
                job.deliver(Update([], [], error=message))

    async def _watch(self) -> None:
        while not tp.parent_gone(self.plan):
            await asyncio.sleep(WATCH_EVERY)
        self._dead = True
        self._fail_all(ENGINE_DIED)
        if self.on_parent_gone is not None:
            self.on_parent_gone()
