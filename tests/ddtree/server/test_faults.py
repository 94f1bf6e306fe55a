"""Failures of ours: a 500 in OpenAI's shape and one log line, never a traceback; repeated log lines are dropped."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddtree.server.app import create_app
from ddtree.server.logs import OncePerWindow
from ddtree.server.model import ServedModel
from ddtree.server.run import make_server
from ddtree.server.text import Detokenizer
from tests.ddtree.server.conftest import settings_for


@pytest.fixture
def faults_log(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """caplog on `ddtree.server.faults`, with a fresh once-per-window filter (none of other tests' lines)."""
    monkeypatch.setattr(logging.getLogger("ddtree.server.faults"), "filters", [OncePerWindow()])
    caplog.set_level(logging.INFO, logger="ddtree.server.faults")
    return caplog


def test_an_unexpected_failure_is_a_500_in_openai_shape_with_one_log_line(
    client: TestClient, served: ServedModel, monkeypatch: pytest.MonkeyPatch, faults_log: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the secret prompt\nover two lines")

    monkeypatch.setattr(served.tokenizer, "encode", broken)
    for _ in range(3):
        response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 500 and response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
        assert "secret" not in error["message"] and "Traceback" not in response.text
    lines = [r for r in faults_log.records if r.name == "ddtree.server.faults"]
    assert len(lines) == 1, "a repeated failure is logged once"
    line = lines[0].getMessage()
    assert lines[0].exc_info is None and "\n" not in line and "secret" not in line
    assert "RuntimeError" in line and "/v1/completions" in line and "test_faults.py" in line
    assert client.get("/health").status_code == 200


def test_once_per_window_drops_repeats_and_says_how_many() -> None:
    now = [0.0]
    guard = OncePerWindow(window_s=60, clock=lambda: now[0])

    def record(message: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, args, None)

    passed = [guard.filter(record("socket.accept() out of system resource\nsocket: fd=%d", i)) for i in range(1000)]
    assert passed.count(True) == 1
    assert guard.filter(record("another kind"))
    now[0] = 61.0
    late = record("socket.accept() out of system resource\nsocket: fd=%d", 7)
    assert guard.filter(late) and "[999 more like this dropped in the last 60 s]" in late.getMessage()
    assert not guard.filter(record("socket.accept() out of system resource\nsocket: fd=%d", 8))


def test_the_loggers_that_may_repeat_are_guarded(tiny_dirs: tuple[Path, Path], served: ServedModel) -> None:
    make_server(create_app(settings_for(tiny_dirs), served), "127.0.0.1", 0)  # configures uvicorn's logging
    for name in ("ddtree.server.faults", "ddtree.server.connections", "asyncio", "uvicorn.error"):
        assert any(isinstance(f, OncePerWindow) for f in logging.getLogger(name).filters), name


def test_a_failure_mid_stream_ends_the_stream_with_an_error_event(
    client: TestClient, served: ServedModel, monkeypatch: pytest.MonkeyPatch, faults_log: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("cannot decode")

    monkeypatch.setattr(Detokenizer, "_decode", broken)  # the first piece of text fails
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    error = json.loads(blocks[-3].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}
    (line,) = [r.getMessage() for r in faults_log.records if r.name == "ddtree.server.faults"]
    assert line.startswith("unexpected ValueError in POST /v1/completions at ") and "test_faults.py" in line
