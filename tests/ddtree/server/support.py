"""Helpers of the server tests: the app's state, the engine's answer alone, waiting for a condition."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, cast

from fastapi import FastAPI
from fastapi.testclient import TestClient

from ddtree.engine.engine import Engine
from ddtree.server.app import ServerState
from ddtree.server.model import ServedModel
from ddtree.server.run import GracefulServer, make_server


def state(client: TestClient) -> ServerState:
    return cast(ServerState, cast(Any, client.app).state.ddtree)


def encode(served: ServedModel, text: str) -> list[int]:
    return [int(i) for i in served.tokenizer.encode(text)]


def alone(
    served: ServedModel, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0
) -> tuple[list[int], str]:
    """What `Engine.generate` gives this prompt alone, and its text."""
    engine = Engine(served.engine.target, served.engine.drafter)
    config = replace(served.generation, temperature=temperature, seed=seed, max_new_tokens=max_tokens)
    ids = engine.generate([prompt], config).outputs[0].token_ids
    return ids, decode(served, ids)


def decode(served: ServedModel, ids: list[int]) -> str:
    return str(served.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def live_server(app: FastAPI) -> Iterator[tuple[str, GracefulServer, threading.Thread]]:
    """The app under uvicorn in a thread, on a socket bound here (no port race): its URL, server, thread."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = make_server(app, "127.0.0.1", 0, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30)
        assert server.started, "uvicorn did not start"
        yield url, server, thread
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"
