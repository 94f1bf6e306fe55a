"""The sampling fields clients send reach the engine: `top_k` and `top_p` cut the target's distribution, and
`logprobs` return the target's log-probabilities of the emitted tokens, whole and streamed, in OpenAI's
formats for completions and chat."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddtree.engine.engine import Engine
from ddtree.server.model import ServedModel
from tests.ddtree.server.support import encode
from tests.ddtree.server.test_api import TEMPLATE

PROMPT = "The tree"


def _post(client: TestClient, path: str, **body: Any) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _engine_logprobs(served: ServedModel, prompt: list[int], tokens: int, top: int) -> tuple[list[int], Any]:
    engine = Engine(served.engine.target, served.engine.drafter)
    config = replace(served.generation, temperature=0.0, max_new_tokens=tokens, logprobs=top)
    out = engine.generate([prompt], config).outputs[0]
    return out.token_ids, out


def test_top_k_1_and_a_tiny_top_p_sample_the_greedy_tokens(client: TestClient) -> None:
    greedy = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=0)["choices"][0]["text"]
    hot = [_post(client, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=s) for s in range(3)]
    assert any(h["choices"][0]["text"] != greedy for h in hot), "T=1.5 should sample something else"
    for seed in range(3):
        k1 = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=seed, top_k=1)
        p0 = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=1.5, seed=seed, top_p=1e-9)
        assert k1["choices"][0]["text"] == greedy == p0["choices"][0]["text"]


def test_completion_logprobs_are_the_targets(client: TestClient, served: ServedModel) -> None:
    body = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    block = body["choices"][0]["logprobs"]
    ids, out = _engine_logprobs(served, encode(served, PROMPT), 10, 3)
    assert len(block["tokens"]) == body["usage"]["completion_tokens"] == len(ids)
    assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(block["token_logprobs"], out.logprobs, strict=True))
    texts = [served.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert block["tokens"] == texts
    assert block["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    for top, token, value, alternatives in zip(
        block["top_logprobs"], texts, block["token_logprobs"], out.top_logprobs, strict=True
    ):
        expected = {served.tokenizer.decode([i], skip_special_tokens=False): v for i, v in alternatives[:3]}
        assert len(alternatives) == 3 and top == {**expected, **({} if token in expected else {token: value})}
    plain = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=10, temperature=0)
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["text"] == body["choices"][0]["text"]


@pytest.fixture
def with_template(served: ServedModel) -> Iterator[ServedModel]:
    served.tokenizer.chat_template = TEMPLATE
    yield served
    served.tokenizer.chat_template = None


@pytest.mark.usefixtures("with_template")
def test_chat_logprobs_whole_and_streamed(client: TestClient) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    body = _post(
        client, "/v1/chat/completions", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(values) == 2 and values == sorted(values, reverse=True) and entry["logprob"] <= values[0]
    request = {"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert streamed == content


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(client: TestClient) -> None:
    full = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=16, temperature=0)["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip():
        stop = full[-2:]
    body = _post(client, "/v1/completions", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0, stop=[stop])
    block = body["choices"][0]["logprobs"]
    assert len(block["tokens"]) == body["usage"]["completion_tokens"]
    assert all(len(top) == 1 for top in block["top_logprobs"])
