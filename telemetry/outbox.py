"""Messages for the exporter process, sent by a thread of their own: the decode thread only appends.

The decode thread (and the server's threads) call `Outbox.put`, which takes a lock, appends and returns: it
never writes to the socket, so a sink that stops draining can never stall them. The sender thread writes
what is queued (steps in groups, one write each) with blocking sends; while the exporter process cannot keep
up, messages wait in the queue. The queue is bounded in bytes (`DDTREE_TELEMETRY_BUFFER_MB`): a step record
that would pass the bound is dropped, a request record (a start or an end) only past twice the bound, so a
slow sink loses steps before it loses the requests that give them meaning.

Every drop is counted in a `DropLedger`, by kind and by id. Once the exporter takes messages again the sender
sends it what was dropped since its last report, which it writes as a `ddtree.telemetry` line; the totals are
what `/metrics` serves. What is still queued when the outbox closes and makes no progress for
`STALL_TIMEOUT_S` is counted too, and said on stderr, since the log is the sink that stalled.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from telemetry import semconv as sc

SEND_EVERY_STEPS = 32  # the sender wakes for this many queued steps, or
SEND_EVERY_S = 0.25  # this often, whichever comes first
WRITE_STEPS = 128  # step records in one write at most: a write's acknowledgement comes within a short wait
STALL_TIMEOUT_S = 5.0  # closing: give up once no record has moved (written or acknowledged) for this long


@dataclass
class DropReport:
    """What was dropped since the last report (ids in the order they were dropped), and the totals so far."""

    steps: list[int] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    totals: dict[str, int] = field(default_factory=dict)  # kind (semconv.DROPPED_*) -> records since start


class DropLedger:
    """Counts dropped records by kind; thread-safe. `take` hands over what is new since the last `take`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.new = DropReport()
        self.totals = {sc.DROPPED_STEP: 0, sc.DROPPED_REQUEST: 0}

    def add_steps(self, steps: list[int]) -> None:
        with self.lock:
            self.new.steps.extend(steps)
            self.totals[sc.DROPPED_STEP] += len(steps)

    def add_requests(self, request_ids: list[str]) -> None:
        with self.lock:
            self.new.requests.extend(request_ids)
            self.totals[sc.DROPPED_REQUEST] += len(request_ids)

    def has_new(self) -> bool:
        with self.lock:
            return bool(self.new.steps or self.new.requests)

    def take(self) -> DropReport | None:
        """What was dropped since the last call, or None if nothing was."""
        with self.lock:
            if not self.new.steps and not self.new.requests:
                return None
            report, self.new = self.new, DropReport()
            report.totals = dict(self.totals)
            return report

    def counts(self) -> dict[str, int]:
        """Records dropped since telemetry started, by kind."""
        with self.lock:
            return dict(self.totals)


@dataclass
class _Item:
    message: tuple[Any, ...]  # ("step", record) is grouped into one ("steps", [records]) write
    size: int  # bytes, estimated
    steps: list[int]  # the step indices it carries (for the ledger, if it is dropped)
    requests: list[str]  # the request ids it carries


class Outbox:
    """A bounded queue in front of `conn`, drained by a sender thread.

    The exporter process acknowledges each message once its sinks have it, so what a write handed over is
    known to be in the sinks or not: a message not acknowledged when the exporter stops (or is given up on at
    close) is counted as dropped, like one never written."""

    def __init__(self, conn: Connection, limit_bytes: int, ledger: DropLedger) -> None:
        self.conn = conn
        self.limit = limit_bytes
        self.ledger = ledger
        self.queue: deque[_Item] = deque()
        self.unacked: deque[list[_Item]] = deque()  # per message written and not yet acknowledged, its items
        self.writing: list[_Item] = []  # the items of the batch being written
        self.queued_bytes = 0  # queued, being written or unacknowledged
        self.queued_steps = 0
        self.cond = threading.Condition()
        self.closing = False
        self.done = False  # the sender thread has ended
        self.gone: str | None = None  # why the exporter process cannot be written to, once it cannot
        self.moved_at = time.monotonic()  # the last write or acknowledgement
        self.thread = threading.Thread(target=self._run, name="ddtree-telemetry-send", daemon=True)
        self.reader = threading.Thread(target=self._acks, name="ddtree-telemetry-acks", daemon=True)
        self.thread.start()
        self.reader.start()

    def put_step(self, step: int, record: tuple[Any, ...], size: int) -> None:
        """Queue a step record, or count it dropped if the queue is full."""
        self._put(_Item(("step", record), size, [step], []), self.limit)

    def put_requests(self, message: tuple[Any, ...], size: int, request_ids: list[str]) -> None:
        """Queue a start or end of requests; dropped (and counted) only past twice the bound."""
        self._put(_Item(message, size, [], request_ids), 2 * self.limit)

    def _put(self, item: _Item, limit: int) -> None:
        with self.cond:
            if self.gone is not None or self.closing or self.queued_bytes + item.size > limit:
                self._drop([item])
                return
            self.queue.append(item)
            self.queued_bytes += item.size
            is_step = item.message[0] == "step"
            self.queued_steps += is_step
            if not is_step or self.queued_steps >= SEND_EVERY_STEPS:
                self.cond.notify_all()

    def _drop(self, items: list[_Item]) -> None:
        self.ledger.add_steps([s for item in items for s in item.steps])
        self.ledger.add_requests([r for item in items for r in item.requests])

    def drain(self) -> bool:
        """Wait until the exporter has acknowledged every record queued so far, for as long as records keep
        moving (a write or an acknowledgement every `STALL_TIMEOUT_S`); True if it has them all."""
        with self.cond:
            self.moved_at = time.monotonic()
            self.cond.notify_all()
            while self._pending() and not self.done and time.monotonic() - self.moved_at < STALL_TIMEOUT_S:
                self.cond.wait(0.05)
            return not self._pending()

    def _pending(self) -> bool:
        return bool(self.queue or self.writing or self.unacked) or self.ledger.has_new()

    def close(self, last: tuple[Any, ...], timeout_s: float) -> bool:
        """Queue `last` (the exporter's close message, which it answers once its sinks are closed) and wait up
        to `timeout_s` (call `drain` first for a backlog); True if the exporter had every record. What it did
        not is counted as dropped and said on stderr (the log may be the sink that stalled)."""
        with self.cond:
            self.queue.append(_Item(last, 0, [], []))
            self.closing = True
            self.cond.notify_all()
            deadline = time.monotonic() + timeout_s
            while not self.done and time.monotonic() < deadline:
                self.cond.wait(0.05)
            left = [*self.queue, *self.writing, *(item for group in self.unacked for item in group)]
            left = [item for item in left if item.message is not last]
            self.queue.clear()
            self.unacked.clear()
            self.writing = []
            self.gone = self.gone or ("its sink stalled" if not self.done else None)
        if left:
            self._drop(left)
            steps = sum(len(item.steps) for item in left)
            print(
                f"ddtree telemetry: the exporter process stopped taking records ({self.gone});"
                f" {steps} step records and {len(left) - steps} request records were dropped",
                file=sys.stderr,
            )
        return self.done and not left

    def _batch(self) -> list[_Item]:
        """Wait for work and take it (the sender's side of the condition)."""
        with self.cond:
            if not self.queue:
                self.cond.wait(SEND_EVERY_S)
            items = list(self.queue)
            self.queue.clear()
            self.queued_steps = 0
            self.writing = items
            return items

    def _run(self) -> None:
        """The sender: writes what is queued until the close message has been answered."""
        try:
            while not self._finished():
                items = self._batch()
                report = self.ledger.take()  # also with nothing queued: drops are said once the sink drains
                if report is not None:
                    self._send(("dropped", report), [])
                for message, group in _writes(items):
                    self._send(message, group)
        except (OSError, ValueError) as exc:  # the exporter process is gone (or the connection closed)
            self._lost(exc)
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def _send(self, message: tuple[Any, ...], group: list[_Item]) -> None:
        """Write one message; its items wait for their acknowledgement from before the write (the answer may
        come before `send` returns)."""
        with self.cond:
            self.unacked.append(group)
            written = {id(item) for item in group}
            self.writing = [item for item in self.writing if id(item) not in written]
        self.conn.send(message)
        with self.cond:
            self.moved_at = time.monotonic()

    def _acks(self) -> None:
        """The reader: each acknowledgement ends the wait of the oldest message written ("ack", or ("ok", None)
        for the close message). The only thread that reads the connection."""
        try:
            while True:
                self.conn.recv()
                with self.cond:
                    group = self.unacked.popleft()
                    self.queued_bytes -= sum(item.size for item in group)
                    self.moved_at = time.monotonic()
                    self.cond.notify_all()
        except (OSError, EOFError, ValueError, TypeError, IndexError) as exc:  # gone, or closed under the read
            self._lost(exc)

    def _lost(self, exc: BaseException) -> None:
        """The exporter process cannot be reached: whatever it has not acknowledged is dropped, and counted."""
        with self.cond:
            if self.gone is None and not (self.closing and not self._pending()):
                self.gone = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._drop([*self.queue, *self.writing, *(item for group in self.unacked for item in group)])
            self.queue.clear()
            self.unacked.clear()
            self.writing = []
            self.queued_bytes = 0
            self.cond.notify_all()

    def _finished(self) -> bool:
        with self.cond:
            return self.gone is not None or (self.closing and not self.queue and not self.unacked and not self.writing)


def _writes(items: list[_Item]) -> list[tuple[tuple[Any, ...], list[_Item]]]:
    """The queued items as writes, each with the items it carries: consecutive step records are grouped, at most
    `WRITE_STEPS` to a ("steps", [records]) message (a write per step costs more than the step's record)."""
    out: list[tuple[tuple[Any, ...], list[_Item]]] = []
    steps: list[_Item] = []

    def flush() -> None:
        if steps:
            out.append((("steps", [s.message[1] for s in steps]), list(steps)))
            steps.clear()

    for item in items:
        if item.message[0] != "step":
            flush()
            out.append((item.message, [item]))
            continue
        steps.append(item)
        if len(steps) == WRITE_STEPS:
            flush()
    flush()
    return out
