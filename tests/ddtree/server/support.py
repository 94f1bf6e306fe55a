"""Helpers of the server tests: the app's state, the engine's answer alone, waiting for a condition."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

from fastapi.testclient import TestClient

from ddtree.engine.decode import Engine
from ddtree.server.app import ServerState
from ddtree.server.model import ServedModel


def state(client: TestClient) -> ServerState:
    return cast(ServerState, cast(Any, client.app).state.ddtree)


def encode(served: ServedModel, text: str) -> list[int]:
    return [int(i) for i in served.tokenizer.encode(text)]


def alone(
    served: ServedModel, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0
) -> tuple[list[int], str]:
    """What `Engine.generate` gives this prompt alone, and its text."""
    engine = Engine(served.engine.target, served.engine.drafter)
    config = replace(served.generation, temperature=temperature, seed=seed, max_new_tokens=max_tokens)
    ids = engine.generate([prompt], config).outputs[0].token_ids
    return ids, decode(served, ids)


def decode(served: ServedModel, ids: list[int]) -> str:
    return str(served.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
