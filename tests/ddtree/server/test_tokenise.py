"""Tokenising a large prompt runs off the event loop: `/health` answers while it is still being tokenised. A
short one is tokenised on the loop.

The tokenizer is made slow on purpose (it waits for an event the test sets), so that the test shows the order
of events, not a timing: `/health` came back while the tokenizer still held the prompt.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddtree.server.app import create_app
from ddtree.server.model import ServedModel
from tests.ddtree.server.conftest import settings_for

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
HOLD_S = 10.0  # how long the slow tokenizer waits to be released before it gives up
LARGE = "many words " * 20_000  # 220 kB: far past the context, refused once tokenised


class SlowTokenizer:
    """The tiny pair's tokenizer, whose encode and chat template wait until the test releases them."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.chat_template = TEMPLATE
        self.entered, self.release, self.done = threading.Event(), threading.Event(), threading.Event()
        self.on_loop: list[bool] = []  # per call: whether it ran on the event loop's thread

    def encode(self, text: str, **kwargs: Any) -> Any:
        return self._slowly(lambda: self._inner.encode(text, **kwargs))

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        return self._slowly(lambda: self._inner.apply_chat_template(messages, chat_template=TEMPLATE, **kwargs))

    def _slowly(self, work: Callable[[], Any]) -> Any:
        self.on_loop.append(_on_loop())
        self.entered.set()
        self.release.wait(HOLD_S)
        try:
            return work()
        finally:
            self.done.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture
def slow_client(tiny_dirs: tuple[Path, Path], served: ServedModel) -> Iterator[tuple[TestClient, SlowTokenizer]]:
    slow = SlowTokenizer(served.tokenizer)
    with TestClient(create_app(settings_for(tiny_dirs), replace(served, tokenizer=slow))) as client:
        yield client, slow
        slow.release.set()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": LARGE, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LARGE}], "max_tokens": 2}),
    ],
)
def test_health_answers_while_a_large_prompt_is_tokenised(
    slow_client: tuple[TestClient, SlowTokenizer], path: str, body: dict[str, Any]
) -> None:
    client, slow = slow_client
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, path, json=body)
        assert slow.entered.wait(30), "the tokenizer was never called"
        health = client.get("/health")
        tokenising = not slow.done.is_set()  # /health came back while the tokenizer still held the prompt
        slow.release.set()
        response = pending.result(timeout=60)
    assert health.status_code == 200 and tokenising
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "a short prompt", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a short prompt"}], "max_tokens": 2}),
    ],
)
def test_a_short_prompt_is_tokenised_on_the_event_loop_and_a_large_one_in_a_thread(
    slow_client: tuple[TestClient, SlowTokenizer], path: str, body: dict[str, Any]
) -> None:
    client, slow = slow_client
    slow.release.set()
    assert client.post(path, json=body).status_code == 200
    assert slow.on_loop == [True]
    large = (
        {**body, "prompt": LARGE} if "prompt" in body else {**body, "messages": [{"role": "user", "content": LARGE}]}
    )
    assert client.post(path, json=large).status_code == 400
    assert slow.on_loop == [True, False]


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
