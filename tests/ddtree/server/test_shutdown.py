"""Graceful shutdown: new work is refused, requests in flight finish within the bound, the process exits 0."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx

from ddtree.server.app import ServerState, create_app
from ddtree.server.model import ServedModel
from tests.ddtree.server.conftest import BUDGET, MAX_MODEL_LEN, settings_for
from tests.ddtree.server.support import alone, encode, free_port, live_server, wait_until

ROOT = Path(__file__).resolve().parents[3]


def _refuses_connections(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return True
    return False


def test_shutdown_lets_requests_in_flight_finish(tiny_dirs: tuple[Path, Path], served: ServedModel) -> None:
    app = create_app(settings_for(tiny_dirs, shutdown_timeout=20), served)
    app_state: ServerState = app.state.ddtree
    worker = app_state.worker
    ids, text = alone(served, encode(served, "in flight"), 12)
    with live_server(app) as (url, server, thread), ThreadPoolExecutor(1) as pool:
        worker.pause()
        body = {"prompt": "in flight", "max_tokens": 12, "temperature": 0}
        in_flight = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=30)
        wait_until(lambda: worker.waiting() == 1)
        server.handle_exit(signal.SIGTERM, None)
        assert app_state.draining
        wait_until(lambda: _refuses_connections(url))  # uvicorn no longer listens
        assert thread.is_alive() and worker.alive  # waiting for the request in flight
        worker.resume()
        response = in_flight.result(timeout=30)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == text
        assert response.json()["usage"]["completion_tokens"] == len(ids)
        thread.join(10)
        assert not thread.is_alive() and not worker.alive


def test_shutdown_is_bounded_by_the_timeout(tiny_dirs: tuple[Path, Path], served: ServedModel) -> None:
    app = create_app(settings_for(tiny_dirs, shutdown_timeout=1), served)
    worker = app.state.ddtree.worker
    with live_server(app) as (url, server, thread), ThreadPoolExecutor(1) as pool:
        worker.pause()  # the request never gets a slot
        stuck = pool.submit(httpx.post, f"{url}/v1/completions", json={"prompt": "stuck"}, timeout=30)
        wait_until(lambda: worker.waiting() == 1)
        started = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        thread.join(15)
        assert not thread.is_alive() and time.monotonic() - started < 8
        assert not worker.alive
        try:
            outcome: object = stuck.result(timeout=10).status_code
        except httpx.HTTPError as exc:
            outcome = exc
        assert outcome != 200, "a request past the shutdown timeout must not succeed"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _logged() -> Iterator[list[logging.LogRecord]]:
    """Every record of the root logger and of uvicorn's (which does not propagate to the root)."""
    handler = _Records()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def test_requests_left_at_the_shutdown_timeout_get_503_and_no_traceback(
    tiny_dirs: tuple[Path, Path], served: ServedModel
) -> None:
    app = create_app(settings_for(tiny_dirs, shutdown_timeout=1), served)
    worker = app.state.ddtree.worker
    body = {"prompt": "left behind", "max_tokens": 4}
    with live_server(app) as (url, server, thread), _logged() as records, ThreadPoolExecutor(2) as pool:
        worker.pause()  # the requests never get a slot
        plain = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=30)
        streamed = pool.submit(httpx.post, f"{url}/v1/completions", json={**body, "stream": True}, timeout=30)
        wait_until(lambda: worker.waiting() == 2)
        server.handle_exit(signal.SIGTERM, None)
        thread.join(15)
        responses = [plain.result(timeout=10), streamed.result(timeout=10)]
    for response in responses:
        assert response.status_code == 503 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "server_shutting_down"
        assert error["param"] is None and response.headers["retry-after"] == "1"
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records if r.exc_info]
    assert not [r for r in records if "Traceback" in r.getMessage() or "Exception in ASGI" in r.getMessage()]


def test_sigterm_on_ddtree_serve_finishes_the_stream_and_exits_0(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = tiny_dirs
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "ddtree.cli", "serve", "--model", str(target), "--drafter", str(drafter)]
    argv += ["--port", str(port), "--budget", str(BUDGET), "--dtype", "float64", "--max-model-len", str(MAX_MODEL_LEN)]
    argv += ["--shutdown-timeout", "30"]
    log = (tmp_path / "serve.log").open("w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not come up within 60 s"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"prompt": "a long answer", "max_tokens": 100, "temperature": 0}
        whole = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert "choices" in whole, whole
        pieces, done = [], False
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line)
            pieces.append(json.loads(first.removeprefix("data: "))["choices"][0]["text"])
            proc.send_signal(signal.SIGTERM)  # mid-stream
            for line in lines:
                if not line:
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                pieces.append(json.loads(data)["choices"][0]["text"])
        assert done and "".join(pieces) == whole["choices"][0]["text"]
        assert proc.wait(timeout=30) == 0, (tmp_path / "serve.log").read_text()
        assert "Shutting down" in (tmp_path / "serve.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
