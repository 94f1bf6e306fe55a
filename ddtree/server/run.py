"""Running the app under uvicorn with a graceful shutdown (what `ddtree serve` calls).

On SIGTERM or SIGINT the app starts draining (new `/v1/*` requests get 503, `/health` 503), uvicorn stops
listening, closes idle connections and waits up to `shutdown_timeout` seconds for the requests in flight
(streams included) to finish, cancels what is left, then runs the lifespan's end, which stops the decode
thread. `serve` then returns normally: the process exits 0. (Plain uvicorn re-raises the signal once it is
done, which kills the process with it; a second SIGINT still forces an immediate exit.)
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import cast

import uvicorn
from fastapi import FastAPI

from ddtree.server.app import ServerState, create_app
from ddtree.server.model import ServerSettings

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose app stops taking work as soon as shutdown starts, and that exits quietly."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.draining = True
        super().handle_exit(sig, frame)

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


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> GracefulServer:
    state = cast(ServerState, app.state.ddtree)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(state.settings.shutdown_timeout),
    )  # uvicorn takes whole seconds
    return GracefulServer(config, state)


def serve(settings: ServerSettings, host: str, port: int) -> None:
    """Load the pair, serve until a signal, shut down gracefully."""
    make_server(create_app(settings), host, port).run()
