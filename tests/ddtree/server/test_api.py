"""The endpoints: OpenAI's formats, the ddtree block, errors, the queue limit, the API key, health, metrics."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddtree.server.model import ServedModel
from tests.ddtree.server.conftest import BUDGET, MAX_MODEL_LEN, MakeClient
from tests.ddtree.server.support import alone, encode, state, wait_until

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def events(response: Any) -> list[Any]:
    """The SSE stream's payloads, `[DONE]` kept as a string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == ""
    out = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def check_ddtree(block: dict[str, Any], completion_tokens: int) -> None:
    assert block["method"] == "ddtree" and block["budget"] == BUDGET and block["topk"] is None
    histogram = block["acceptance_histogram"]
    assert sum(histogram) == block["steps"] >= 1
    accepted = sum((i + 1) * n for i, n in enumerate(histogram))
    assert block["mean_acceptance_length"] == pytest.approx(accepted / block["steps"])
    assert accepted + 1 >= completion_tokens  # the prefill's token, then every step's accepted tokens


def test_completion_is_the_engines_output_with_usage_and_ddtree(client: TestClient, served: ServedModel) -> None:
    ids, text = alone(served, encode(served, "Hello, tree"), 24)
    body = client.post("/v1/completions", json={"prompt": "Hello, tree", "max_tokens": 24, "temperature": 0}).json()
    assert body["object"] == "text_completion" and body["model"] == served.model_id
    assert body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["text"] == text and choice["index"] == 0
    assert choice["finish_reason"] == ("stop" if len(ids) < 24 else "length")
    prompt_tokens = len(encode(served, "Hello, tree"))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(ids),
        "total_tokens": prompt_tokens + len(ids),
    }
    check_ddtree(body["ddtree"], len(ids))


def test_token_id_prompts_and_defaults(client: TestClient, served: ServedModel) -> None:
    prompt = encode(served, "ids")
    by_ids = client.post("/v1/completions", json={"prompt": prompt, "temperature": 0, "seed": 3}).json()
    by_text = client.post("/v1/completions", json={"prompt": ["ids"], "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"] == alone(served, prompt, 16)[1]
    assert by_ids["usage"]["completion_tokens"] <= 16  # OpenAI's default max_tokens


def test_chat_without_a_template_is_a_clear_400(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "no chat template" in error["message"] and error["param"] == "messages"


@pytest.fixture
def with_template(served: ServedModel) -> Any:
    served.tokenizer.chat_template = TEMPLATE
    yield served
    served.tokenizer.chat_template = None


def test_chat_uses_the_template_and_streams_with_a_role(client: TestClient, with_template: ServedModel) -> None:
    served = with_template
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    prompt = encode(served, "<system>be brief\n<user>hi\n<assistant>")
    ids, text = alone(served, prompt, 20)
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 20, "temperature": 0}).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == len(ids)
    request = {"messages": messages, "max_completion_tokens": 20, "temperature": 0, "stream": True}
    chunks = events(client.post("/v1/chat/completions", json=request))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == text
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length") and "ddtree" in chunks[-2]
    assert chunks[-1] == "[DONE]"


def test_chat_default_max_tokens_is_the_rest_of_the_context(client: TestClient, with_template: ServedModel) -> None:
    messages = [{"role": "user", "content": "x" * (MAX_MODEL_LEN - 20)}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0}).json()
    assert body["usage"]["total_tokens"] <= MAX_MODEL_LEN
    too_long = [{"role": "user", "content": "x" * MAX_MODEL_LEN}]
    response = client.post("/v1/chat/completions", json={"messages": too_long})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


def test_stream_ends_with_done_and_carries_usage_and_ddtree(client: TestClient, served: ServedModel) -> None:
    request: dict[str, Any] = {"prompt": "stream me", "max_tokens": 20, "temperature": 0, "stream": True}
    whole = client.post("/v1/completions", json={**request, "stream": False}).json()
    plain = events(client.post("/v1/completions", json=request))
    assert plain[-1] == "[DONE]"
    final = plain[-2]
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert "usage" not in final and final["ddtree"] == whole["ddtree"]
    assert "".join(c["choices"][0]["text"] for c in plain[:-1]) == whole["choices"][0]["text"]
    assert all("ddtree" not in c for c in plain[:-2])

    usage = events(client.post("/v1/completions", json={**request, "stream_options": {"include_usage": True}}))
    assert usage[-1] == "[DONE]"
    assert usage[-2]["choices"] == [] and usage[-2]["usage"] == whole["usage"]
    assert usage[-2]["ddtree"] == whole["ddtree"]
    assert usage[-3]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["usage"] is None for c in usage[:-2])


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x", "n": 2}, "n", "n must be 1"),
        ({"prompt": "x", "temperature": 3}, "temperature", "less than or equal to 2"),
        ({"prompt": "x", "temperature": -0.5}, "temperature", "greater than or equal to 0"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"prompt": "x", "stop": ["ok", ""]}, "stop", "must not be empty"),
        ({"prompt": "x" * MAX_MODEL_LEN}, "prompt", "maximum context length is 160"),
        ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "prompt", "maximum context length is 160"),
        ({"prompt": ""}, "prompt", "no tokens"),
        ({"prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
        ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ({}, "prompt", "Field required"),
    ],
)
def test_bad_requests_are_400_with_an_openai_error(
    client: TestClient, body: dict[str, Any], param: str, words: str
) -> None:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_malformed_json_is_400(client: TestClient) -> None:
    response = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def test_a_full_queue_gets_429_with_retry_after(make_client: MakeClient) -> None:
    with make_client(max_batch_size=1, max_queue=1) as client:
        worker = state(client).worker
        worker.pause()
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(client.post, "/v1/completions", json={"prompt": "a", "max_tokens": 4})
            wait_until(lambda: worker.waiting() == 1)
            refused = client.post("/v1/completions", json={"prompt": "b", "max_tokens": 4})
            worker.resume()
            assert queued.result(timeout=30).status_code == 200
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        assert client.post("/v1/completions", json={"prompt": "b", "max_tokens": 4}).status_code == 200


def test_api_key(make_client: MakeClient) -> None:
    with make_client(api_key="sekret") as client:
        body = {"prompt": "a", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            response = client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models").status_code == 401
        good = {"Authorization": "Bearer sekret"}
        assert client.post("/v1/completions", json=body, headers=good).status_code == 200
        assert client.get("/v1/models", headers=good).status_code == 200
        assert client.get("/health").status_code == 200  # probes and scrapers need no key
        assert client.get("/metrics").status_code == 200


def test_models_health_and_metrics(client: TestClient, served: ServedModel) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == served.model_id and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json={"prompt": "count me", "max_tokens": 5, "temperature": 0}).json()
    assert client.post("/v1/completions", json={"prompt": "x", "n": 3}).status_code == 400
    assert client.get("/nowhere").status_code == 404
    text = client.get("/metrics").text
    samples = _samples(text)
    assert samples['ddtree_http_requests_total{endpoint="/v1/completions",status="200"}'] == 1
    assert samples['ddtree_http_requests_total{endpoint="/v1/completions",status="400"}'] == 1
    assert samples['ddtree_http_requests_total{endpoint="other",status="404"}'] == 1
    assert samples['ddtree_http_request_duration_seconds_count{endpoint="/v1/completions"}'] == 2
    assert _count(samples, 'gen_ai_server_time_to_first_token_seconds_count{endpoint="/v1/completions",') == 1
    per_token = 1 if ok["usage"]["completion_tokens"] > 1 else 0  # a request of one token has no time per token
    assert _count(samples, 'gen_ai_server_time_per_output_token_seconds_count{endpoint="/v1/completions",') == per_token
    generated = samples['ddtree_generated_tokens_total{endpoint="/v1/completions"}']
    assert generated == ok["usage"]["completion_tokens"]
    assert samples["ddtree_waiting_requests"] == 0 and samples["ddtree_running_requests"] == 0


def _count(samples: dict[str, float], prefix: str) -> float:
    """The sum of the samples whose name and first labels are `prefix` (the GenAI labels follow)."""
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def _samples(text: str) -> dict[str, float]:
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {name: float(value) for name, value in lines}


def test_health_is_503_and_requests_fail_once_the_loop_has_stopped(
    client: TestClient, served: ServedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed step whose session cannot be rebuilt ends the decode thread."""
    worker = state(client).worker
    assert worker.session is not None

    def broken(*args: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(worker.session, "step", broken)
    monkeypatch.setattr(served, "new_session", broken)
    failed = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    wait_until(lambda: not worker.alive)
    assert client.get("/health").status_code == 503
    refused = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_gathers_tokens_per_chunk(make_client: MakeClient, interval: int) -> None:
    """`--stream-interval N`: every chunk but the last carries N tokens or more (a step's tokens are not split:
    1 keeps a chunk per step), and the text is the same."""
    request: dict[str, Any] = {"prompt": "gather me", "max_tokens": 30, "temperature": 0, "logprobs": 0}
    with make_client(stream_interval=interval) as client:
        whole = client.post("/v1/completions", json=request).json()
        chunks = events(client.post("/v1/completions", json={**request, "stream": True}))[:-1]
    counts = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"][0]["logprobs"]]
    assert sum(counts) == whole["usage"]["completion_tokens"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    if interval == 1:
        assert len(counts) == whole["ddtree"]["steps"] + 1  # the prefill's token, then each step's
    else:
        assert all(n >= interval for n in counts[:-1]) and len(counts) <= -(-sum(counts) // interval) + 1
