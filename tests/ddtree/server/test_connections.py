"""Slow and idle clients against a real uvicorn server on 127.0.0.1: half-sent requests are closed after their
timeouts, the connection cap makes room for new clients, and running out of descriptors cannot happen."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import httpx
import pytest

from ddtree.errors import UserError
from ddtree.server.app import create_app
from ddtree.server.connections import (
    BODY_BACKSTOP_S,
    ConnectionTable,
    GuardedH11Protocol,
    connection_budget,
    descriptors_needed,
    fd_limit,
)
from ddtree.server.model import ServedModel, check_settings
from ddtree.server.run import GracefulServer, make_server
from tests.ddtree.server.conftest import BUDGET, MAX_MODEL_LEN, settings_for
from tests.ddtree.server.support import free_port, live_server, stop_process, wait_until

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 1.0  # the head and body timeouts of these servers
HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: applica"
HALF_BODY = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 400\r\n\r\n"
    b'{"prompt": "never fini'
)
REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"


def _connect(url: str, payload: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    if payload:
        sock.sendall(payload)
    return sock


def _read_to_eof(sock: socket.socket, deadline: float) -> bytes | None:
    """What the server sent until it closed the connection; None if it was still open at the deadline."""
    received = b""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def _still_open(sock: socket.socket) -> bool:
    """Whether the server has not closed the connection (as far as this end has heard); does not wait."""
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))  # data: open; b"": closed
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.setblocking(True)


def _table(server: GracefulServer) -> ConnectionTable:
    return cast(type[GuardedH11Protocol], server.config.http_protocol_class).table


def test_half_sent_requests_are_closed_after_their_timeouts(tiny_dirs: tuple[Path, Path], served: ServedModel) -> None:
    settings = settings_for(tiny_dirs, header_timeout=TIMEOUT_S, body_timeout=TIMEOUT_S)
    with live_server(create_app(settings, served)) as (url, server, _):
        silent = [_connect(url, b"") for _ in range(100)]
        heads = [_connect(url, HALF_HEAD) for _ in range(100)]
        bodies = [_connect(url, HALF_BODY) for _ in range(100)]
        opened = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200  # served while 300 connections stall
        deadline = opened + TIMEOUT_S + BODY_BACKSTOP_S + 5
        for sock in silent + heads:
            assert _read_to_eof(sock, deadline) == b"", "a connection without its request head was kept open"
        for sock in bodies:
            answer = _read_to_eof(sock, deadline)
            assert answer is not None, "a connection with half its body was kept open"
            assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in answer, answer
        for sock in silent + heads + bodies:
            sock.close()
        wait_until(lambda: _table(server).open == 0 and not server.server_state.connections)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_a_request_sent_slowly_but_in_time_is_served(tiny_dirs: tuple[Path, Path], served: ServedModel) -> None:
    settings = settings_for(tiny_dirs, header_timeout=2 * TIMEOUT_S, body_timeout=2 * TIMEOUT_S)
    body = b'{"prompt": "slow", "max_tokens": 2}'
    request = REQUEST % (len(body), body)
    with live_server(create_app(settings, served)) as (url, _, _):
        sock = _connect(url, b"")
        for piece in (request[:20], request[20:-10], request[-10:]):
            time.sleep(TIMEOUT_S / 2)  # each pause shorter than the timeouts, all of them not
            sock.sendall(piece)
        answer = _read_to_eof(sock, time.monotonic() + 30)
        sock.close()
    assert answer is not None and answer.startswith(b"HTTP/1.1 200 "), answer


def test_at_the_cap_the_longest_waiting_connection_makes_room(
    tiny_dirs: tuple[Path, Path], served: ServedModel
) -> None:
    settings = settings_for(tiny_dirs, max_connections=20, header_timeout=60)
    with live_server(create_app(settings, served)) as (url, server, _):
        idle = [_connect(url, HALF_HEAD) for _ in range(20)]
        wait_until(lambda: _table(server).open == 20)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert _read_to_eof(idle[0], time.monotonic() + 5) == b""  # the oldest made room for /health
        assert all(_still_open(sock) for sock in idle[1:])
        more = [_connect(url, b"") for _ in range(30)]
        wait_until(lambda: sum(_still_open(s) for s in idle + more) == 20)
        assert all(_still_open(sock) for sock in more[10:])  # the newest 20 are the ones kept
        assert _table(server).open <= 20
        for sock in idle + more:
            sock.close()


def test_with_every_connection_busy_a_new_one_gets_503(tiny_dirs: tuple[Path, Path], served: ServedModel) -> None:
    app = create_app(settings_for(tiny_dirs, max_connections=2), served)
    worker = app.state.ddtree.worker
    body = b'{"prompt": "busy", "max_tokens": 2}'
    with live_server(app) as (url, _, _):
        worker.pause()
        busy = [_connect(url, REQUEST % (len(body), body)) for _ in range(2)]
        wait_until(lambda: worker.waiting() == 2)
        refused = _read_to_eof(_connect(url, b""), time.monotonic() + 5)
        assert refused is not None and refused.startswith(b"HTTP/1.1 503 "), refused
        assert b'"code":"too_many_connections"' in refused and b'"type":"server_error"' in refused
        worker.resume()
        for sock in busy:
            answer = _read_to_eof(sock, time.monotonic() + 30)
            assert answer is not None and answer.startswith(b"HTTP/1.1 200 "), answer
            sock.close()


def test_an_unfinished_head_over_max_header_bytes_is_a_400(tiny_dirs: tuple[Path, Path], served: ServedModel) -> None:
    settings = settings_for(tiny_dirs, max_header_bytes=1024)
    with live_server(create_app(settings, served)) as (url, _, _):
        ok = _connect(url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 512 + b"\r\n\r\n")
        big = _connect(url, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 2048)  # buffered, not yet parsed
        assert (_read_to_eof(big, time.monotonic() + 10) or b"").startswith(b"HTTP/1.1 400 ")
        assert ok.recv(4096).startswith(b"HTTP/1.1 200 ")
        ok.close()
        big.close()


def test_uvicorn_gets_the_settings_it_has_names_for(tiny_dirs: tuple[Path, Path], served: ServedModel) -> None:
    settings = settings_for(tiny_dirs, keep_alive_timeout=7, max_header_bytes=4096, backlog=33, max_connections=44)
    server = make_server(create_app(settings, served), "127.0.0.1", 0)
    config = server.config
    assert (config.timeout_keep_alive, config.h11_max_incomplete_event_size, config.backlog) == (7, 4096, 33)
    assert config.limit_concurrency is None  # the cap is the protocol's, at accept time
    protocol = cast(type, config.http)
    assert issubclass(protocol, GuardedH11Protocol) and protocol.table.limits.max_connections == 44


def test_the_default_cap_and_backlog_are_sized_from_the_descriptor_limit() -> None:
    assert connection_budget(None, None, 1024) == (672, 56)
    assert connection_budget(None, None, 20000) == (13128, 1093)
    assert connection_budget(None, None, 10**7) == (16384, 2048)
    assert connection_budget(None, None, 64) == (1, 1)
    assert connection_budget(100, None, 1024) == (100, 56) and connection_budget(None, 50, 1024) == (696, 50)
    assert connection_budget(None, None, None) == (16384, 2048)  # no limit
    for fds in (256, 512, 1024, 4096, 20000, 10**6):  # what a burst of accepts can take stays within the limit
        assert descriptors_needed(*connection_budget(None, None, fds)) <= fds


def test_settings_that_would_run_out_of_descriptors_are_refused(tiny_dirs: tuple[Path, Path]) -> None:
    limit = fd_limit()
    assert limit is not None
    with pytest.raises(UserError, match="file descriptors"):
        check_settings(settings_for(tiny_dirs, max_connections=limit, backlog=16))
    check_settings(settings_for(tiny_dirs, max_connections=16, backlog=16))


SERVE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({fds}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from ddtree.runtime import EngineOptions
from ddtree.server.model import ServerSettings
from ddtree.server.launch import serve
settings = ServerSettings(model={model!r}, drafter={drafter!r}, budget={budget}, max_model_len={length},
                          options=EngineOptions(dtype="float64"), header_timeout=30)
serve(settings, "127.0.0.1", {port})
"""


@contextmanager
def _serving(tiny_dirs: tuple[Path, Path], fds: int, log: Path) -> Iterator[str]:
    """`serve` in a process of its own, with a soft limit of `fds` file descriptors; its URL."""
    target, drafter = tiny_dirs
    port = free_port()
    facts = {"model": str(target), "drafter": str(drafter), "budget": BUDGET, "length": MAX_MODEL_LEN}
    code = SERVE.format(fds=fds, port=port, **facts)
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: proc.poll() is not None or _healthy(url), 60)
            assert proc.poll() is None, log.read_text()
            yield url
        finally:
            stop_process(proc)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_more_connections_than_descriptors_leave_the_server_up_and_the_log_quiet(
    tiny_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """The default cap (from the descriptor limit) keeps accept() from failing: no EMFILE, no traceback flood."""
    fds, log = 512, tmp_path / "serve.log"
    with _serving(tiny_dirs, fds, log) as url, ThreadPoolExecutor(8) as pool:
        stalled = list(pool.map(lambda _: _connect(url, HALF_HEAD), range(2 * fds)))  # twice the limit
        answered = [httpx.get(f"{url}/health", timeout=5).status_code for _ in range(5)]
        for sock in stalled:
            sock.close()
    text = log.read_text()
    assert answered == [200] * 5
    assert "Too many open files" not in text and "Traceback" not in text, text[-4000:]
    assert len(text) < 20_000, "the log grew with the connections"
