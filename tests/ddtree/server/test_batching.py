"""The decode thread: concurrent requests get what they get alone, joins mid-generation, stop strings,
cancellation and failures."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddtree.server.model import ServedModel
from tests.ddtree.server.support import alone, decode, encode, state, wait_until

PROMPTS = ["Hello", "The tree", "ab", "Speculative decoding is", "x"]
NEW = [30, 12, 25, 18, 9]


def complete(client: TestClient, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **extra})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_concurrent_greedy_requests_get_what_they_get_alone(client: TestClient, served: ServedModel) -> None:
    """Five requests from five threads on three slots: three join at once, two wait and join as slots free."""
    worker = state(client).worker
    occupied: list[int] = []
    worker.step_hook = lambda steps, slots: occupied.append(slots)
    worker.pause()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(complete, client, p, n, temperature=0) for p, n in zip(PROMPTS, NEW, strict=True)]
        wait_until(lambda: worker.waiting() == len(PROMPTS))
        worker.resume()
        bodies = [f.result(30) for f in futures]
    assert max(occupied) == 3
    for prompt, new, body in zip(PROMPTS, NEW, bodies, strict=True):
        ids, text = alone(served, encode(served, prompt), new)
        assert body["choices"][0]["text"] == text, prompt
        assert body["usage"]["completion_tokens"] == len(ids)
    assert worker.running() == 0 and worker.waiting() == 0


def test_a_request_joins_while_another_is_mid_generation(client: TestClient, served: ServedModel) -> None:
    """The decode thread holds after its third step until the second request waits, then goes on."""
    worker = state(client).worker
    occupied: list[int] = []
    held, go = threading.Event(), threading.Event()

    def hook(steps: int, slots: int) -> None:
        occupied.append(slots)
        if len(occupied) == 3:
            held.set()
            go.wait(10)

    worker.step_hook = hook
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, client, "Hello", 40, temperature=0)
        assert held.wait(10)
        second = pool.submit(complete, client, "tree", 10, temperature=0)
        wait_until(lambda: worker.waiting() == 1)
        go.set()
        bodies = [first.result(30), second.result(30)]
    assert occupied[:4] == [1, 1, 1, 2]  # alone for three steps, then both
    for (prompt, new), body in zip([("Hello", 40), ("tree", 10)], bodies, strict=True):
        assert body["choices"][0]["text"] == alone(served, encode(served, prompt), new)[1]


def test_seeded_sampling_does_not_depend_on_the_batch(client: TestClient, served: ServedModel) -> None:
    sampled = {"temperature": 0.9, "seed": 1234}
    solo = complete(client, "Hello", 24, **sampled)
    worker = state(client).worker
    worker.pause()
    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(complete, client, p, 30, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS[1:3])]
        batched = pool.submit(complete, client, "Hello", 24, **sampled)
        wait_until(lambda: worker.waiting() == 3)
        worker.resume()
        assert all(o.result(30)["choices"][0]["text"] for o in others)
        assert batched.result(30)["choices"][0]["text"] == solo["choices"][0]["text"]
    assert solo["choices"][0]["text"] == alone(served, encode(served, "Hello"), 24, 0.9, 1234)[1]
    assert solo["choices"][0]["text"] != alone(served, encode(served, "Hello"), 24)[1]  # it did sample


def _stop_case(served: ServedModel) -> tuple[list[int], str, str]:
    """The greedy output of a prompt and a two-character stop string from its middle (no U+FFFD in it)."""
    ids, text = alone(served, encode(served, "Hello"), 40)
    start = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    return ids, text, text[start : start + 2]


def test_stop_strings_across_token_boundaries(client: TestClient, served: ServedModel) -> None:
    ids, text, stop = _stop_case(served)
    cut = text.index(stop)
    used = next(k for k in range(1, len(ids) + 1) if stop in decode(served, ids[:k]))  # the token completing it
    assert used >= 2 and len(stop.encode()) >= 2  # the stop string spans tokens (one byte each)
    body = complete(client, "Hello", 40, temperature=0, stop=["never seen \u2603", stop])
    assert body["choices"][0]["text"] == text[:cut]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == used
    stream = client.post(
        "/v1/completions", json={"prompt": "Hello", "max_tokens": 40, "temperature": 0, "stop": stop, "stream": True}
    )
    chunks = [json.loads(b.removeprefix("data: ")) for b in stream.text.split("\n\n")[:-2]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[:cut]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    worker = state(client).worker
    wait_until(lambda: worker.running() == 0)  # the slot is left at the next step boundary
    assert worker.cancelled == 2


def test_a_failed_step_is_a_500_and_the_server_goes_on(
    client: TestClient, served: ServedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = state(client).worker
    assert worker.session is not None

    def broken() -> list[int]:
        raise RuntimeError("device lost")

    monkeypatch.setattr(worker.session, "step", broken)
    failed = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error"
    stream = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0, "stream": True})
    assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")  # a fresh session
    assert worker.failures == 1 and worker.alive
    assert client.get("/health").status_code == 200
    body = complete(client, "Hello", 8, temperature=0)
    assert body["choices"][0]["text"] == alone(served, encode(served, "Hello"), 8)[1]
