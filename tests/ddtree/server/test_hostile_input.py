"""Input the tokenizer or the engine cannot take is a 400 in OpenAI's shape that names the value, never a 500.

The bodies are raw bytes: a JSON escape such as `\\ud800` (a lone surrogate) is valid JSON, and no JSON
library on the client side would write it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddtree.server.model import ServedModel
from ddtree.server.schemas import MAX_STOP_CHARS, MAX_STOPS

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"

COMPLETIONS = [
    (rb'{"prompt": "\ud800", "max_tokens": 2}', "prompt", ["lone surrogate", r"'\ud800'", "character 0"]),
    (rb'{"prompt": "ok \udfff", "max_tokens": 2}', "prompt", ["lone surrogate", r"'\udfff'", "character 3"]),
    (rb'{"prompt": ["\ud800"], "max_tokens": 2}', "prompt", ["lone surrogate"]),
    (rb'{"prompt": "a\u0000b", "max_tokens": 2}', "prompt", ["NUL character", "character 1"]),
    (rb'{"prompt": "x", "model": "\ud800"}', "model", ["model: ", "lone surrogate"]),
    (rb'{"prompt": "x", "stop": ["ok", "\ud800"]}', "stop", ["stop[1]: ", "lone surrogate"]),
    (rb'{"prompt": "x", "user": "\ud800"}', "user", ["user: ", "lone surrogate"]),
    (rb'{"prompt": [-1], "max_tokens": 2}', "prompt", ["outside the vocabulary", "-1 at index 0"]),
    (rb'{"prompt": [1, 258], "max_tokens": 2}', "prompt", ["outside the vocabulary [0, 258)", "258 at index 1"]),
    (rb'{"prompt": [[5, 99999]], "max_tokens": 2}', "prompt", ["99999 at index 1"]),
    (rb'{"prompt": [100000000000000000000000000000000]}', "prompt", ["outside the vocabulary", "1000000000"]),
    (rb'{"prompt": [true, 2], "max_tokens": 2}', "prompt", ["token ids are integers", "true at index 0"]),
    (rb'{"prompt": [1, 2.5], "max_tokens": 2}', "prompt", ["token ids are integers", "2.5 at index 1"]),
    (rb'{"prompt": [1, null]}', "prompt", ["null at index 1"]),
    (rb'{"prompt": [1e400]}', "prompt", ["token ids are integers"]),
    (rb'{"prompt": [[[1]]]}', "prompt", ["one prompt per request"]),
    (rb'{"prompt": [[1], [2]]}', "prompt", ["one prompt per request"]),
    (rb'{"prompt": [1, [2]]}', "prompt", ["one prompt per request"]),
    (rb'{"prompt": {"ids": [1]}}', "prompt", ["valid string"]),
    (rb'{"prompt": [[]]}', "prompt", ["no tokens"]),
    (rb'{"prompt": "x", "max_tokens": 100000000000000000000000000000}', "max_tokens", ["less than or equal"]),
    (rb'{"prompt": "x", "temperature": NaN}', "temperature", ["finite number"]),
    (rb'{"prompt": "x", "temperature": -Infinity}', "temperature", ["finite number"]),
    (rb'{"prompt": "x", "n": 100000000000000000000000000000000000}', "n", ["n must be 1", "..."]),
]

CHAT = [
    (rb'{"messages": [{"role": "user", "content": "\ud800"}]}', ["messages[0].content: ", "lone surrogate"]),
    (rb'{"messages": [{"role": "\udbff", "content": "x"}]}', ["messages[0].role: ", r"'\udbff'"]),
    (rb'{"messages": [{"role": "user", "content": "a\u0000"}]}', ["messages[0].content: ", "NUL character"]),
    (
        rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
        ["messages[0].content[0].text: "],
    ),
    (rb'{"messages": [{"role": "user", "content": "x", "name": "\udfff"}]}', ["messages[0].name: "]),
    (
        rb'{"messages": [{"role": "user", "content": "x", "tool": {"a": [1, {"b": "\ud800"}]}}]}',
        ["messages[0].tool.a[1].b: ", "lone surrogate"],
    ),
    (rb'{"messages": [{"role": "user", "content": "x", "tool": {"\ud800": 1}}]}', ["messages[0].tool (a key): "]),
    (rb'{"messages": [[1]]}', ["messages: "]),
]


def _error(response: Any, param: str | None) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    return error


def _post(client: TestClient, path: str, body: bytes) -> Any:
    return client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("body", "param", "words"), COMPLETIONS)
def test_completions_refuse_what_cannot_be_encoded_with_a_400(
    client: TestClient, body: bytes, param: str | None, words: list[str] | None
) -> None:
    response = _post(client, "/v1/completions", body)
    if words is None:
        assert response.status_code == 200, response.text
        return
    message = _error(response, param)["message"]
    assert all(w in message for w in words), message


@pytest.fixture
def with_template(served: ServedModel) -> Iterator[ServedModel]:
    served.tokenizer.chat_template = TEMPLATE
    yield served
    served.tokenizer.chat_template = None


@pytest.mark.parametrize(("body", "words"), CHAT)
def test_chat_refuses_what_cannot_be_encoded_with_a_400(
    client: TestClient, with_template: ServedModel, body: bytes, words: list[str]
) -> None:
    message = _error(_post(client, "/v1/chat/completions", body), "messages")["message"]
    assert all(w in message for w in words), message


def test_bodies_that_are_not_json_or_not_utf8_are_400(client: TestClient) -> None:
    for body in (b'{"prompt": "\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000, b"\x00\x01", b'{"prompt": "x"'):
        _error(_post(client, "/v1/completions", body), None)


def test_stop_strings_are_bounded(client: TestClient) -> None:
    many = {"prompt": "x", "max_tokens": 2, "stop": [f"s{i}" for i in range(MAX_STOPS + 1)]}
    error = _error(client.post("/v1/completions", json=many), "stop")
    assert f"at most {MAX_STOPS} stop strings, got {MAX_STOPS + 1}" in error["message"]
    long = {"prompt": "x", "max_tokens": 2, "stop": "y" * (MAX_STOP_CHARS + 1)}
    error = _error(client.post("/v1/completions", json=long), "stop")
    assert f"at most {MAX_STOP_CHARS} characters" in error["message"]
    fine = {"prompt": "x", "max_tokens": 2, "stop": ["y" * MAX_STOP_CHARS] * MAX_STOPS}
    assert client.post("/v1/completions", json=fine).status_code == 200
