"""The body fields clients send: none is silently ignored. Unknown fields and known ones this server does not
implement are a 400 that names them (unless their value changes nothing); `--served-model-name` names the
model everywhere a client sees it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddtree.errors import UserError
from ddtree.server.app import create_app
from ddtree.server.model import check_settings, load_model
from tests.ddtree.server.conftest import MakeClient, settings_for

COMPLETION = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def _error(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("tools", [{"type": "function"}], "does not support this field"),
        ("temprature", 0.5, "does not support this field"),
        ("presence_penalty", 0.5, "presence_penalty is not supported"),
        ("frequency_penalty", -1.0, "frequency_penalty is not supported"),
        ("logit_bias", {"5": 10}, "logit_bias is not supported"),
        ("best_of", 2, "best_of is not supported"),
        ("echo", True, "echo is not supported"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_k", -2, "greater than or equal to -1"),
        ("logprobs", 21, "less than or equal to 20"),
    ],
)
def test_unsupported_fields_are_a_400_that_names_them(client: TestClient, field: str, value: Any, words: str) -> None:
    error = _error(client, "/v1/completions", {**COMPLETION, field: value})
    assert words in error["message"] and field in error["message"]
    assert error["type"] == "invalid_request_error"


def test_neutral_values_of_unimplemented_fields_are_accepted(client: TestClient) -> None:
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1, "echo": False}
    plain = client.post("/v1/completions", json=COMPLETION).json()
    both = client.post("/v1/completions", json={**COMPLETION, **neutral, "user": "someone"})
    assert both.status_code == 200, both.text
    assert both.json()["choices"][0]["text"] == plain["choices"][0]["text"]


def test_chat_fields(client: TestClient) -> None:
    assert (
        "top_logprobs needs logprobs" in _error(client, "/v1/chat/completions", {**CHAT, "top_logprobs": 2})["message"]
    )
    assert "does not support" in _error(client, "/v1/chat/completions", {**CHAT, "response_format": {}})["message"]
    assert (
        "does not support" in _error(client, "/v1/completions", {**COMPLETION, "stream_options": {"x": 1}})["message"]
    )


def test_served_model_name_is_what_clients_see(tiny_dirs: tuple[Path, Path], make_client: MakeClient) -> None:
    named = load_model(settings_for(tiny_dirs, served_model_name="tiny-chat"))
    with TestClient(create_app(settings_for(tiny_dirs, served_model_name="tiny-chat"), named)) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny-chat"]
        body = client.post("/v1/completions", json={**COMPLETION, "model": "tiny-chat"}).json()
        assert body["model"] == "tiny-chat"
        wrong = client.post("/v1/completions", json={**COMPLETION, "model": tiny_dirs[0].name})
        assert wrong.status_code == 404 and "tiny-chat" in wrong.json()["error"]["message"]
    with pytest.raises(UserError, match="--served-model-name"):
        check_settings(settings_for(tiny_dirs, served_model_name=" "))
