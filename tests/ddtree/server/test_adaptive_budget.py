"""`ddtree serve --budget adaptive`: requests get ar's tokens, and the `ddtree` block says which width each step
ran and the gain it predicted."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ddtree.adaptive import adaptive_widths
from ddtree.errors import UserError
from ddtree.server.app import create_app
from ddtree.server.model import check_settings, load_model
from tests.ddtree.server.conftest import settings_for
from tests.ddtree.server.support import alone, encode


def test_an_adaptive_server_serves_ar_tokens_and_names_each_steps_width(tiny_dirs: tuple[Path, Path]) -> None:
    settings = settings_for(tiny_dirs, budget=8, adaptive=True)
    served = load_model(settings)
    assert served.card().adaptive and "budget adaptive (up to 8)" in served.card().describe()
    ar = replace(served, generation=replace(served.generation, method="ar", adaptive=False))
    with TestClient(create_app(settings, served)) as client:
        response = client.post("/v1/completions", json={"prompt": "The tree", "max_tokens": 15, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    _, text = alone(ar, encode(served, "The tree"), 15)
    assert body["choices"][0]["text"] == text
    block = body["ddtree"]
    assert block["budget"] == "adaptive" and block["max_budget"] == 8
    assert len(block["step_budgets"]) == len(block["step_gains"]) == block["steps"] > 0
    assert set(block["step_budgets"]) <= set(adaptive_widths(8))
    assert all(g >= 1.0 for g in block["step_gains"])  # a width is chosen only where it beats ar's prediction


def test_adaptive_takes_no_schedule(tiny_dirs: tuple[Path, Path]) -> None:
    with pytest.raises(UserError, match="--budget adaptive"):
        check_settings(settings_for(tiny_dirs, adaptive=True, auto_budget=True))
