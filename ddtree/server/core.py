"""The engine core process: it owns the decode session (through `DecodeWorker`), warm-up and telemetry, and
talks to the API server processes in typed messages (`ddtree.server.transport`).

Two threads, each with sockets of its own (ZMQ sockets are not shared between threads):
- the main thread reads the inbox: it submits and cancels jobs, answers a full queue with `Rejected`, and sends
  every API process a `Status` when what it reads changed the queue (at most each `STATUS_AFTER_CHANGE`
  seconds, and once each `STATUS_EVERY` seconds in any case);
- the decode thread (`DecodeWorker`) steps; each request's update of a round is kept, and once the round is
  delivered (`DecodeWorker.delivered`) it goes out as one `Outputs` message per API process.

The process ends on `Stop`, on SIGTERM, or when the launcher is gone; it never reads pickle from a socket.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import zmq

from ddtree.errors import CapacityError, SettingsError, UserError
from ddtree.models.pair import resolve_device
from ddtree.server import transport as tp
from ddtree.server.model import ServedModel, ServerSettings, load_model
from ddtree.server.worker import (
    REJECTED_QUEUE_FULL,
    REJECTED_STOPPED,
    DecodeWorker,
    Job,
    QueueFull,
    Update,
    WorkerStopped,
)

log = logging.getLogger(__name__)

POLL_MS = 100  # the inbox is read at least this often: signals and a gone launcher are noticed
STATUS_EVERY = 1.0  # seconds between status messages while nothing else is sent
STATUS_AFTER_CHANGE = 0.05  # at most this often for a change of queue (every step's outputs carry it too)


@dataclass
class _Entry:
    api: int
    rid: int
    job: Job
    first: bool = True  # no update sent yet: the next carries the queue time and, with the first token, the prefill's


class EngineCore:
    def __init__(self, served: ServedModel, settings: ServerSettings, plan: tp.Plan) -> None:
        self.served = served
        self.plan = plan
        self.worker = DecodeWorker(lambda: served.new_session(settings.max_batch_size), settings.max_queue)
        self.worker.delivered = self._flush
        self._context: zmq.Context[Any] = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(plan.engine_inbox)
        # the decode thread's sockets and the main thread's, one per API process each
        self._out = [tp.push(self._context, plan.api_inbox(i)) for i in range(plan.api_count)]
        self._replies = [tp.push(self._context, plan.api_inbox(i)) for i in range(plan.api_count)]
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._lock = threading.Lock()
        self._round: list[tuple[_Entry, Update]] = []  # the decode thread's: this round's updates
        self._told = (0, 0)  # the decode thread's: (waiting, running) as its last round told every API process
        self.dropped = 0  # messages an API process could not take
        self._stop = threading.Event()

    def start(self) -> None:
        """Build the session and warm it up (compile and capture before the first request), start stepping."""
        self.worker.start()

    def status(self) -> tp.Status:
        worker = self.worker
        dropped = self.served.telemetry.dropped()
        return tp.Status(worker.waiting(), worker.running(), worker.slots(), worker.alive, dict(dropped))

    def run(self) -> None:
        """Read the inbox until `Stop`, a signal or a gone launcher; then stop the decode thread."""
        last_status, changed = 0.0, False
        try:
            while not self._stop.is_set() and not tp.parent_gone(self.plan):
                if self._inbox.poll(POLL_MS):
                    while (data := self._receive()) is not None:
                        changed = self._handle(data) or changed
                now = time.monotonic()
                since = now - last_status
                if (changed and since >= STATUS_AFTER_CHANGE) or since >= STATUS_EVERY:
                    self._broadcast(self.status())
                    last_status, changed = now, False
        finally:
            self.worker.stop()
            self.served.telemetry.shutdown()
            self._context.destroy(linger=0)
            if self.dropped:
                log.warning("%d messages to API processes that had gone were dropped", self.dropped)

    def stop(self) -> None:
        self._stop.set()

    # -- the main thread ----------------------------------------------------------------------------------

    def _receive(self) -> bytes | None:
        try:
            return bytes(self._inbox.recv(flags=zmq.NOBLOCK))
        except zmq.Again:
            return None

    def _handle(self, data: bytes) -> bool:
        """One message; True where it changed the queue (so the APIs hear the new status)."""
        try:
            message = tp.decode_for_engine(data)
        except msgspec.DecodeError as exc:
            log.error("a message that is not ours reached the engine: %s", exc)
            return False
        if isinstance(message, tp.Submit):
            self._submit(message)
        elif isinstance(message, tp.Cancel):
            with self._lock:  # a cancelled job hears nothing more
                entry = self._entries.pop((message.api, message.rid), None)
            if entry is not None:
                self.worker.cancel(entry.job, message.reason)
        elif isinstance(message, tp.Abandon):
            with self._lock:
                gone = [self._entries.pop(key) for key in list(self._entries) if key[0] == message.api]
            for entry in gone:
                self.worker.cancel(entry.job)
            log.warning("API process %d is gone: %d of its requests cancelled", message.api, len(gone))
        else:
            self._stop.set()
        return True

    def _submit(self, message: tp.Submit) -> None:
        key = (message.api, message.rid)
        entry = _Entry(message.api, message.rid, Job(message.request, lambda update: self._keep(key, update)))
        with self._lock:
            self._entries[key] = entry
        try:
            self.worker.submit(entry.job)
        except (QueueFull, WorkerStopped) as exc:
            with self._lock:
                self._entries.pop(key, None)
            reason = REJECTED_QUEUE_FULL if isinstance(exc, QueueFull) else REJECTED_STOPPED
            rejected = tp.Rejected(message.rid, reason, str(exc), self.status())
            self._send(self._replies, message.api, rejected)

    def _broadcast(self, status: tp.Status) -> None:
        for api in range(self.plan.api_count):
            self._send(self._replies, api, status)

    def _send(self, sockets: list[zmq.Socket[Any]], api: int, message: tp.ToApi) -> None:
        if not tp.try_send(sockets[api], message):
            self.dropped += 1

    # -- the decode thread --------------------------------------------------------------------------------

    def _keep(self, key: tuple[int, int], update: Update) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and (update.finish_reason is not None or update.error is not None):
                del self._entries[key]
        if entry is not None:
            self._round.append((entry, update))

    def _flush(self) -> None:
        """The round's updates, one message per API process; the others hear the engine's state where the
        round changed it (a join, a leave), so that any API process's `/metrics` is current."""
        by_api: dict[int, list[tp.Out]] = defaultdict(list)
        for entry, update in self._round:
            by_api[entry.api].append(_out(entry, update))
        self._round = []
        status = self.status()
        for api, outs in by_api.items():
            self._send(self._out, api, tp.Outputs(outs, status))
        if (status.waiting, status.running) != self._told:
            self._told = (status.waiting, status.running)
            for api in range(self.plan.api_count):
                if api not in by_api:
                    self._send(self._out, api, status)


def _out(entry: _Entry, update: Update) -> tp.Out:
    job, queued, prefill = entry.job, None, None
    if entry.first:  # a request's first update is the one with its first token, unless it ended without one
        entry.first = False
        if job.queued_at is not None and job.joined_at is not None:
            queued = max(job.joined_at - job.queued_at, 0.0)
        if job.first_at is not None and job.joined_at is not None:
            prefill = max(job.first_at - job.joined_at, 0.0)
    return tp.Out(
        entry.rid,
        update.token_ids,
        update.acceptance_lengths,
        update.budgets,
        update.scores,
        update.finish_reason,
        update.error,
        queued,
        update.gains,
        prefill,
    )


def _share_cores(settings: ServerSettings, plan: tp.Plan) -> None:
    """On the CPU, torch's threads leave a core to each API process (unless OMP_NUM_THREADS says otherwise):
    threads that spin waiting for a core that an API process holds slow every step several times over."""
    if os.environ.get("OMP_NUM_THREADS") or resolve_device(settings.options.device).type != "cpu":
        return
    torch.set_num_threads(max(1, tp.usable_cores() - plan.api_count))


def engine_main(settings: ServerSettings, plan: tp.Plan, ready: Connection) -> None:
    """The engine process: load the pair, warm up, say `ready` (with the model's card) or why not, then serve."""
    logging.basicConfig(level=logging.INFO, format="ddtree engine: %(message)s")
    _share_cores(settings, plan)
    try:
        served = load_model(settings)
        core = EngineCore(served, settings, plan)
        core.start()
    except SettingsError as exc:  # the launcher raises it again, for the CLI to name the flag
        ready.send_bytes(msgspec.msgpack.encode({"error": str(exc), "setting": exc.setting, "problem": exc.problem}))
        raise SystemExit(1) from None
    except (UserError, CapacityError) as exc:
        ready.send_bytes(msgspec.msgpack.encode({"error": str(exc)}))
        raise SystemExit(1) from None
    except Exception as exc:
        ready.send_bytes(msgspec.msgpack.encode({"error": f"the engine failed to start: {exc!r}"}))
        raise SystemExit(1) from None
    signal.signal(signal.SIGTERM, lambda *_: core.stop())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; Ctrl-C reaches the whole group
    ready.send_bytes(msgspec.msgpack.encode({"card": msgspec.to_builtins(served.card())}))
    ready.close()
    core.run()
