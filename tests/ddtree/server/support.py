"""Helpers of the server tests: the app's state, the engine's answer alone, waiting for a condition."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import psutil
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


ROOT = Path(__file__).resolve().parents[3]
STARTUP = re.compile(r"^ddtree serve: .* at http://127\.0\.0\.1:(\d+) \(OpenAI API under /v1\)$", re.M)


@dataclass
class ServeProcess:
    """`ddtree serve` run as users run it: its process, URL and log."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def text(self) -> str:
        return self.log.read_text()

    def processes(self, workers_only: bool = True) -> list[psutil.Process]:
        """The launcher's children, oldest first: the engine process and the API processes (and, unless
        `workers_only`, multiprocessing's resource tracker)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        if workers_only:
            children = [c for c in children if "spawn_main" in " ".join(_cmdline(c))]
        return sorted(children, key=lambda c: c.create_time())


@contextmanager
def serve_process(
    tiny_dirs: tuple[Path, Path], log: Path, *flags: str, timeout: float = 90.0, env: dict[str, str] | None = None
) -> Iterator[ServeProcess]:
    """`ddtree serve` on the tiny pair in float64 on a free port (`--port 0`; the start-up line says which),
    up once the line is out; SIGTERM at the end (killed, and its children, if it is still there)."""
    target, drafter = tiny_dirs
    argv = [sys.executable, "-m", "ddtree.cli", "serve", "--model", str(target), "--drafter", str(drafter)]
    argv += ["--port", "0", "--dtype", "float64", *flags]
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=environ)
    server = ServeProcess(proc, "", log)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + timeout
        while (found := STARTUP.search(server.text())) is None:
            assert proc.poll() is None, server.text()
            assert time.monotonic() < deadline, f"no start-up line within {timeout} s:\n{server.text()}"
            time.sleep(0.1)
        server.url = f"http://127.0.0.1:{found[1]}"
        children = server.processes(workers_only=False)
        yield server
    finally:
        if proc.poll() is None:
            stop_process(proc, 60)
        for child in children:  # nothing left behind, whatever the test did
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def stop_process(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """SIGTERM, as an operator stops a server; killed if it has not ended within `timeout` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return list(process.cmdline())
    except psutil.Error:
        return []
