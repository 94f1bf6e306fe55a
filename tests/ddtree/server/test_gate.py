"""Refusals before any work: bodies over the limit (413), unknown models (404), a server shutting down (503)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddtree.server.model import ServedModel
from tests.ddtree.server.conftest import MakeClient
from tests.ddtree.server.support import state

LIMIT = 256


def _error(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


def test_bodies_over_the_limit_are_413(make_client: MakeClient) -> None:
    with make_client(max_body_bytes=LIMIT) as client:
        big = {"prompt": "x" * LIMIT, "max_tokens": 2}
        error = _error(client.post("/v1/completions", json=big), 413, "request_too_large")
        assert error["type"] == "invalid_request_error" and f"limit is {LIMIT} bytes" in error["message"]
        _error(
            client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * LIMIT}]}),
            413,
            "request_too_large",
        )

        def chunks() -> Iterator[bytes]:  # no Content-Length: the size is counted as the body is read
            yield b'{"prompt": "'
            for _ in range(LIMIT // 16):
                yield b"z" * 16
            yield b'", "max_tokens": 2}'

        chunked = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in chunked.request.headers
        _error(chunked, 413, "request_too_large")

        def small() -> Iterator[bytes]:
            yield b'{"prompt": "ok", '
            yield b'"max_tokens": 2}'

        assert client.post("/v1/completions", content=small(), headers={"content-type": "application/json"}).is_success
        assert client.post(
            "/v1/completions", json={"prompt": "ok", "max_tokens": 2, "user": "u" * (LIMIT - 64)}
        ).is_success
        metrics = client.get("/metrics").text
        assert 'ddtree_http_requests_total{endpoint="/v1/completions",status="413"} 2.0' in metrics


def test_the_default_limit_is_one_mebibyte(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"prompt": "x" * (1 << 20)})
    _error(response, 413, "request_too_large")


@pytest.fixture
def chat_template(served: ServedModel) -> Iterator[None]:
    served.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    yield
    served.tokenizer.chat_template = None


def test_an_unknown_model_is_404_and_the_served_one_or_none_is_accepted(
    client: TestClient, served: ServedModel, chat_template: None
) -> None:
    listed = client.get("/v1/models").json()["data"][0]["id"]
    assert listed == served.model_id
    messages = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": messages})):
        body = {**body, "max_tokens": 2, "temperature": 0}
        error = _error(client.post(path, json={**body, "model": "gpt-4o"}), 404, "model_not_found")
        assert error["type"] == "invalid_request_error" and "gpt-4o" in error["message"]
        assert listed in error["message"] and error["param"] == "model"
        for named in ({"model": listed}, {"model": None}, {}):
            response = client.post(path, json={**body, **named})
            assert response.status_code == 200, response.text
            assert response.json()["model"] == listed


def test_a_draining_server_refuses_new_work_with_503(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    state(client).draining = True
    error = _error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 503, "server_shutting_down")
    assert error["type"] == "server_error"
    assert client.get("/v1/models").status_code == 503
    health = client.get("/health")
    assert health.status_code == 503 and health.json() == {"status": "shutting down"}
    assert client.get("/metrics").status_code == 200
    state(client).draining = False
