"""Connections under uvicorn that a slow or idle client cannot pile up: a timeout on the request head and a cap.

uvicorn has neither: a connection that sends part of its head (slowloris), or nothing at all, is kept for
ever (its keep-alive timer starts only after a first response, and each byte that arrives resets it), and
connections are accepted until the process runs out of file descriptors, when asyncio logs a traceback per
failed accept. Its `limit_concurrency` does not help: it is checked once a request's head is in, which a
slowloris connection never sends, and it answers text/plain 503s with a warning each. So the HTTP protocol
is a subclass of uvicorn's h11 one (the one layer that sees a connection before its request exists; an ASGI
middleware is only called once the head has been parsed):

- Head timeout: from the moment a connection opens, or its previous response ends (keep-alive), the next
  request's head (request line and headers) must be in within `header_timeout` seconds, else the connection
  is closed. Idle keep-alive connections are closed sooner, by uvicorn's `timeout_keep_alive`.
- Body backstop: the body itself is timed by `ddtree.server.gate` (408 after `body_timeout`); should nothing
  read it, the connection is closed `BODY_BACKSTOP_S` seconds later.
- Cap: at most `max_connections` connections. One more closes the connection that has waited longest for
  its request head (a slowloris one, or an idle keep-alive one), so that new clients keep getting in; when
  every connection has a request in progress, the new one gets a 503 (`code` `too_many_connections`) and
  is closed. The default cap and backlog are sized from the file-descriptor limit (`connection_budget`), so
  that accept() never runs out of descriptors (asyncio would log a traceback for each failure).

Both are logged once per window (`ddtree.server.logs`), never per connection.
"""

from __future__ import annotations

import asyncio
import json
import resource
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ddtree.server.logs import guarded_logger

log = guarded_logger(__name__)  # each kind of line once a minute

BODY_BACKSTOP_S = 2.0
FD_RESERVE_MIN = 128  # descriptors kept for everything but client connections (model files, threads, logs)
MAX_BACKLOG = 2048  # uvicorn's default
BURST_BACKLOGS = 4  # backlogs' worth of descriptors a burst of accepts can take before the cap acts
MAX_DEFAULT_CONNECTIONS = 16384
TOO_MANY = "too_many_connections"


def fd_limit() -> int | None:
    """The soft limit on open file descriptors (`ulimit -n`); None when there is none."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


def connection_budget(max_connections: int | None, backlog: int | None, fds: int | None = None) -> tuple[int, int]:
    """(max_connections, backlog), each the one given or sized from the descriptor limit `fds`.

    asyncio accepts up to `backlog` connections per loop turn, and a connection reaches the protocol (and
    the cap) only two turns after its accept, while evicted ones free their descriptors a turn after their
    close: so a burst can hold about `max_connections + BURST_BACKLOGS * backlog` descriptors. Of the limit,
    max(FD_RESERVE_MIN, limit / 8) is kept for the rest of the process; of what is left, a sixteenth (at most
    MAX_BACKLOG) is the backlog, and the cap is the rest less BURST_BACKLOGS backlogs (at most
    MAX_DEFAULT_CONNECTIONS). 1024 descriptors give 672 connections and a backlog of 56; 20000 give 13128
    and 1093.
    """
    if fds is None:
        return max_connections or MAX_DEFAULT_CONNECTIONS, backlog or MAX_BACKLOG
    usable = fds - max(FD_RESERVE_MIN, fds // 8)
    if backlog is None:
        backlog = max(1, min(MAX_BACKLOG, usable // 16))
    if max_connections is None:
        max_connections = max(1, min(usable - BURST_BACKLOGS * backlog, MAX_DEFAULT_CONNECTIONS))
    return max_connections, backlog


def descriptors_needed(max_connections: int, backlog: int) -> int:
    """What a burst of connections can take at most, with the reserve for the rest of the process."""
    return max_connections + BURST_BACKLOGS * backlog + FD_RESERVE_MIN


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout: float  # seconds to the whole request head
    body_timeout: float  # the gate's 408; the protocol closes BODY_BACKSTOP_S later


@dataclass(eq=False)
class ConnectionTable:
    """The connections of one server: how many are open, and those waiting for a request head, oldest first."""

    limits: ConnectionLimits
    open: int = 0
    waiting: dict[GuardedH11Protocol, None] = field(default_factory=dict)  # insertion order: oldest first

    def admit(self) -> bool:
        """Whether one more connection may open; at the cap, the oldest waiting one is closed to make room."""
        if self.open < self.limits.max_connections:
            return True
        cap = self.limits.max_connections
        if not self.waiting:
            log.warning("refusing connections: all %d allowed have a request in progress", cap)
            return False
        log.warning("at the cap of %d connections: closing those that have waited longest for a request", cap)
        next(iter(self.waiting)).drop()
        return True


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), with a connection table of its own."""

    class Guarded(GuardedH11Protocol):
        table = ConnectionTable(limits)

    return Guarded


class GuardedH11Protocol(H11Protocol):
    table: ConnectionTable  # set by `guarded_protocol`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused = False
        self._counted = False  # in `table.open`
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if not self.table.admit():
            self._refused = True
            transport.write(_REFUSAL)
            transport.close()
            return
        self.table.open += 1
        self._counted = True
        super().connection_made(transport)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return  # uvicorn never saw it
        self._forget()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def drop(self) -> None:
        """Close the connection now; it counts as closed at once (its descriptor goes with the next loop turn)."""
        self._forget()
        self.transport.close()

    def _forget(self) -> None:
        if self._counted:
            self._counted = False
            self.table.open -= 1
        self._stop_head_timer()
        self._stop_body_timer()

    def _track(self) -> None:
        """Start or stop the timers for the state the client's side of the connection is now in."""
        state = self.conn.their_state
        if state is h11.IDLE and not self.transport.is_closing():  # waiting for (the rest of) a request head
            if self._head_timer is None:
                self.table.waiting[self] = None
                self._head_timer = self.loop.call_later(self.table.limits.header_timeout, self._timed_out, "head")
            return
        self._stop_head_timer()
        if state is h11.SEND_BODY and not self.transport.is_closing():
            if self._body_timer is None:
                backstop = self.table.limits.body_timeout + BODY_BACKSTOP_S
                self._body_timer = self.loop.call_later(backstop, self._timed_out, "body")
        else:  # the whole request is in, or the connection is closing
            self._stop_body_timer()

    def _stop_head_timer(self) -> None:
        self.table.waiting.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _timed_out(self, part: str) -> None:
        self._head_timer = self._body_timer = None
        log.warning("closing connections whose request %s did not arrive in time", part)
        self.drop()


def _refusal() -> bytes:
    body = {
        "error": {
            "message": "the server has too many open connections; retry later",
            "type": "server_error",
            "param": None,
            "code": TOO_MANY,
        }
    }
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"retry-after: 1\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


_REFUSAL = _refusal()
