"""Running the app under uvicorn with a graceful shutdown (what each API process of `ddtree serve` runs).

On SIGTERM or SIGINT the app starts draining (new `/v1/*` requests get 503, `/health` 503), uvicorn stops
listening, closes idle connections and waits up to `shutdown_timeout` seconds for the requests in flight
(streams included) to finish, cancels what is left, then runs the lifespan's end, which closes the engine
link. The process then ends normally (exit 0), and the launcher stops the engine once every API process has
(`ddtree.server.launch`). (Plain uvicorn re-raises the signal once it is done, which kills the process with
it; a second SIGINT still forces an immediate exit.) Requests still unfinished when the timeout runs out are
answered 503 (`ddtree.server.faults`).

Connections: uvicorn's own settings where it has them (`timeout_keep_alive`, `h11_max_incomplete_event_size`,
`backlog`, from `ServerSettings`), and the h11 protocol of `ddtree.server.connections` for the head timeout
and the connection cap, which uvicorn has not. Log lines that repeat (asyncio's, uvicorn's, ours) are let
through once a minute (`ddtree.server.logs`).

Start-up: once the engine has loaded the pair and every API process listens, the launcher prints one line on
stderr saying what is served where (`startup_line`), with the port bound (`--port 0` picks one).
"""

from __future__ import annotations

import contextlib
import math
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import cast

import uvicorn
from fastapi import FastAPI

from ddtree.server.app import ServerState
from ddtree.server.card import ModelCard
from ddtree.server.connections import ConnectionLimits, connection_budget, fd_limit, guarded_protocol
from ddtree.server.logs import guard_logs

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose app stops taking work as soon as shutdown starts, and that exits quietly."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.on_started: Callable[[], None] | None = None  # once listening (an API process tells its launcher)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def url(self) -> str:
        """Where the server listens: the configured host, and the port bound (which `--port 0` leaves open)."""
        bound = [s.getsockname() for server in getattr(self, "servers", []) for s in server.sockets]
        port = bound[0][1] if bound and isinstance(bound[0], tuple) else self.config.port
        return url_of(self.config.host, port)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.draining = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.draining = True  # however the exit was asked for (`should_exit` set directly, too)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, less re-raising the signal at the end: the shutdown was the signal's whole effect."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info", processes: int = 1) -> GracefulServer:
    """uvicorn for `app`; `processes`: API processes that share the port, and so `--max-connections`."""
    state = cast(ServerState, app.state.ddtree)
    settings = state.settings
    max_connections, backlog = connection_budget(settings.max_connections, settings.backlog, fd_limit())
    if settings.max_connections is not None:
        max_connections = max(1, math.ceil(max_connections / processes))
    limits = ConnectionLimits(
        max_connections, header_timeout=settings.header_timeout, body_timeout=settings.body_timeout
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(limits),
        ws="none",  # no WebSocket routes
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout),  # uvicorn takes whole seconds
        timeout_keep_alive=settings.keep_alive_timeout,
        h11_max_incomplete_event_size=settings.max_header_bytes,
        backlog=backlog,
    )  # configures logging: the filters go on after it
    guard_logs()
    return GracefulServer(config, state)


def startup_line(card: ModelCard, url: str, api_servers: int) -> str:
    """`ddtree serve: SmolLM2-135M-Instruct, method ddtree, budget 32, cuda, bfloat16, graphs on, 4 API server
    processes, at http://127.0.0.1:8000 (OpenAI API under /v1)`."""
    processes = f"{api_servers} API server process" + ("es" if api_servers != 1 else "")
    return f"ddtree serve: {card.describe()}, {processes}, at {url} (OpenAI API under /v1)"


def url_of(host: str, port: int) -> str:
    host = host or "0.0.0.0"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
