"""`ddtree serve --budget auto`: each step verifies the tree the schedule gives its active requests, requests
get what they get alone, the `ddtree` block names each step's budget, and a missing schedule falls back to the
fixed budget with one line that says so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from ddtree.errors import UserError
from ddtree.runtime import pair_identity, schedule_path
from ddtree.schedule import BudgetSchedule, Choice, write_schedule
from ddtree.server.app import create_app
from ddtree.server.model import ServedModel, check_settings, load_model
from ddtree.server.run import startup_line
from tests.ddtree.server.conftest import BUDGET, settings_for
from tests.ddtree.server.support import alone, encode, state, wait_until

SCHEDULE = BudgetSchedule((Choice(1, "ddtree", 12), Choice(2, "ar"), Choice(3, "ddtree", 3, 2)))
PROMPTS = ["Hello", "The tree", "ab"]
NEW = [20, 14, 17]


@pytest.fixture(scope="module")
def auto_served(tiny_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    path = tmp_path_factory.mktemp("schedule") / "schedule.json"
    write_schedule(path, SCHEDULE)
    return load_model(settings_for(tiny_dirs, budget_schedule=str(path), auto_budget=True))


def _complete(client: TestClient, prompt: str, max_tokens: int) -> dict[str, Any]:
    response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_requests_under_a_schedule_get_what_they_get_alone(
    tiny_dirs: tuple[Path, Path], auto_served: ServedModel
) -> None:
    settings = settings_for(tiny_dirs, budget_schedule="unused", auto_budget=True)
    with TestClient(create_app(settings, auto_served)) as client:
        worker = state(client).worker
        worker.pause()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = [pool.submit(_complete, client, p, n) for p, n in zip(PROMPTS, NEW, strict=True)]
            wait_until(lambda: worker.waiting() == len(PROMPTS))
            worker.resume()
            bodies = [f.result(60) for f in futures]
        lone = _complete(client, PROMPTS[0], NEW[0])
    for prompt, new, body in zip(PROMPTS, NEW, bodies, strict=True):
        _, text = alone(auto_served, encode(auto_served, prompt), new)
        assert body["choices"][0]["text"] == text
        block = body["ddtree"]
        assert block["budget"] == "auto" and block["topk"] is None
        assert len(block["step_budgets"]) == block["steps"] and set(block["step_budgets"]) <= {12, 0, 3}
    seen = {b for body in bodies for b in body["ddtree"]["step_budgets"]}
    assert 3 in seen, "three requests decoding together run the 3-row choice"
    assert set(lone["ddtree"]["step_budgets"]) == {12}, "a request alone runs the 1-row choice"


def test_the_startup_line_lists_the_schedule(auto_served: ServedModel) -> None:
    line = startup_line(auto_served.card(), "http://127.0.0.1:1", 1)
    assert "budget auto (1 rows: ddtree B=12, 2 rows: ar, 3 rows: ddtree B=3 k=2)" in line


def test_auto_without_a_schedule_serves_the_fixed_budget_and_says_so(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DDTREE_HOME", str(tmp_path))
    served = load_model(settings_for(tiny_dirs, auto_budget=True))
    err = capsys.readouterr().err
    assert served.schedule is None and served.tree_budget == BUDGET
    lines = [line for line in err.splitlines() if "--budget auto" in line]
    assert len(lines) == 1 and "ddtree tune" in lines[0] and f"fixed budget {BUDGET}" in lines[0]


def test_auto_finds_the_schedule_tuned_for_this_pair_and_device(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, served: ServedModel
) -> None:
    monkeypatch.setenv("DDTREE_HOME", str(tmp_path))
    target, drafter = tiny_dirs
    identity = pair_identity(str(target), str(drafter), served.engine.target)
    write_schedule(schedule_path(identity), BudgetSchedule(SCHEDULE.choices, identity))
    found = load_model(settings_for(tiny_dirs, auto_budget=True))
    assert found.schedule is not None and found.schedule.choices == SCHEDULE.choices
    other = {**identity, "device": "another device"}
    write_schedule(schedule_path(identity), BudgetSchedule(SCHEDULE.choices, other))
    assert load_model(settings_for(tiny_dirs, auto_budget=True)).schedule is None, "tuned elsewhere: not used"


def test_bad_schedules_are_refused_before_loading(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text('{"format": "ddtree.schedule/1", "choices": [{"batch_size": 1, "method": "dflash"}]}')
    with pytest.raises(UserError, match="is not a budget schedule"):
        check_settings(settings_for(tiny_dirs, budget_schedule=str(broken), auto_budget=True))
    with pytest.raises(UserError, match="needs --method ddtree"):
        check_settings(settings_for(tiny_dirs, method="dflash", auto_budget=True))
