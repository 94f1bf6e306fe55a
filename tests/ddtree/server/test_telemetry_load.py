"""`ddtree serve` with telemetry on (`DDTREE_DEBUG_METRICS=1`): under 64 streaming clients on this machine every
step reaches the log, and a log pipe that stops draining costs counted records, never an answer."""

from __future__ import annotations

import fcntl
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from ddtree.server.app import create_app
from ddtree.server.model import ServedModel, load_model
from telemetry import process
from telemetry import semconv as sc
from tests.ddtree.server.conftest import settings_for
from tests.ddtree.server.support import live_server, wait_until

CLIENTS = 64
WORDS = ["a", "tree", "of", "drafts", "checked", "by", "the", "target", "in", "one", "pass"]
DROPPED_STEPS = f'{sc.PROM_DROPPED_RECORDS_TOTAL}{{{sc.LABEL_KIND}="{sc.DROPPED_STEP}"}}'


def _served(tiny_dirs: tuple[Path, Path], log: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> ServedModel:
    for name, value in {
        "DDTREE_DEBUG_METRICS": "1",
        "DDTREE_LOG_FILE": str(log),
        "OTEL_TRACES_EXPORTER": "none",
    }.items():
        monkeypatch.setenv(name, value)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return load_model(settings_for(tiny_dirs, max_batch_size=16, max_queue=CLIENTS))


def _stream(url: str, i: int) -> int:
    """One streaming completion; the completion tokens it was served."""
    prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 9))
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 8 + i % 33, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            data = line.removeprefix("data: ")
            if line and data != "[DONE]":
                usage = json.loads(data).get("usage") or usage
    assert usage is not None
    return int(usage["completion_tokens"])


def _samples(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in lines}


def test_64_streaming_clients_and_every_step_is_logged(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "log.jsonl"
    served = _served(tiny_dirs, log, monkeypatch)
    app = create_app(settings_for(tiny_dirs, max_batch_size=16, max_queue=CLIENTS), served)
    try:
        with live_server(app) as (url, _, _), ThreadPoolExecutor(CLIENTS) as pool:
            served_tokens = sum(pool.map(lambda i: _stream(url, i), range(CLIENTS)))
            assert _samples(url)[DROPPED_STEPS] == 0
    finally:
        served.telemetry.shutdown(timeout_s=60)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [line for line in lines if line["event"] == sc.EVENT_STEP]
    requests = [line for line in lines if line["event"] == sc.EVENT_REQUEST]
    assert len(requests) == CLIENTS
    assert sum(sum(line[sc.FIELD_EMITTED]) for line in steps) + len(requests) == served_tokens
    assert sum(line[sc.FIELD_STEPS] for line in requests) == sum(len(line[sc.FIELD_REQUEST_IDS]) for line in steps)
    assert not [line for line in lines if sc.FIELD_DROPPED_STEPS in line]
    assert served.telemetry.dropped() == {sc.DROPPED_STEP: 0, sc.DROPPED_REQUEST: 0}


def test_a_log_pipe_that_stops_draining_leaves_the_server_answering(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo = tmp_path / "log.pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that reads nothing while the requests run
    fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)
    monkeypatch.setattr(process, "RECORD_BYTES", 1 << 17)  # eight step records fill the queue's MiB
    served = _served(tiny_dirs, fifo, monkeypatch, DDTREE_TELEMETRY_BUFFER_MB="1")
    app = create_app(settings_for(tiny_dirs, max_batch_size=16, max_queue=CLIENTS), served)
    chunks: list[bytes] = []
    with ThreadPoolExecutor(1) as pool:
        with live_server(app) as (url, _, _):  # at its end, the server shuts telemetry down
            steps = 0
            for i in range(120):  # one at a time: each step serves one request, so the steps add up
                body = {"prompt": WORDS[i % len(WORDS)], "max_tokens": 12, "temperature": 0}
                reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30)  # a stall fails here
                assert reply.status_code == 200, reply.text
                steps += reply.json()["ddtree"]["steps"]
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            dropped = _samples(url)[DROPPED_STEPS]
            assert dropped > 0, "the stalled pipe made telemetry drop steps, and /metrics says how many"
            os.set_blocking(reader, True)  # the pipe's reader wakes up: what was kept reaches the log
            done = pool.submit(lambda: [chunks.append(c) for c in iter(lambda: os.read(reader, 1 << 16), b"")])
            # and, with no request running, the log soon says what was dropped (not only at shutdown)
            wait_until(lambda: sc.FIELD_DROPPED_STEP_IDS.encode() in b"".join(chunks), timeout=30)
        done.result(60)
    os.close(reader)
    lines = [json.loads(line) for line in b"".join(chunks).decode().splitlines()]
    logged = [line[sc.FIELD_STEP] for line in lines if line["event"] == sc.EVENT_STEP]
    said = [s for line in lines if sc.FIELD_DROPPED_STEP_IDS in line for s in line[sc.FIELD_DROPPED_STEP_IDS]]
    assert len(said) == served.telemetry.dropped()[sc.DROPPED_STEP] >= dropped
    assert len(set(logged) | set(said)) == len(logged) + len(said) == steps, "each step logged or said dropped"
