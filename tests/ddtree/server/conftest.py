"""Apps on the tiny pair, in float64 so that greedy comparisons with the engine alone are exact."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

# starlette 1.x prefers `httpx2` for its TestClient; plain httpx works and is what the project pins.
warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
from fastapi.testclient import TestClient  # noqa: E402

from ddtree.runtime import EngineOptions  # noqa: E402
from ddtree.server.app import create_app  # noqa: E402
from ddtree.server.model import ServedModel, ServerSettings, load_model  # noqa: E402

MAX_MODEL_LEN = 160
BUDGET = 8


def settings_for(tiny_dirs: tuple[Path, Path], **overrides: Any) -> ServerSettings:
    target, drafter = tiny_dirs
    base = ServerSettings(
        model=str(target),
        drafter=str(drafter),
        method="ddtree",
        budget=BUDGET,
        max_batch_size=3,
        max_queue=8,
        max_model_len=MAX_MODEL_LEN,
        options=EngineOptions(dtype="float64"),
    )
    return replace(base, **overrides)


@pytest.fixture(scope="package")
def served(tiny_dirs: tuple[Path, Path]) -> ServedModel:
    return load_model(settings_for(tiny_dirs))


MakeClient = Callable[..., AbstractContextManager[TestClient]]


@pytest.fixture
def make_client(tiny_dirs: tuple[Path, Path], served: ServedModel) -> MakeClient:
    @contextmanager
    def make(**overrides: Any) -> Iterator[TestClient]:
        with TestClient(create_app(settings_for(tiny_dirs, **overrides), served)) as client:
            yield client

    return make


@pytest.fixture
def client(make_client: MakeClient) -> Iterator[TestClient]:
    with make_client() as c:
        yield c
