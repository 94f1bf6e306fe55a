"""The log of a session whose budget follows the load: each step line names the tree that step verified (as
the request's output does), and the analysis counts a request's steps of every tree as its own."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ddtree.engine.engine import Engine
from ddtree.schedule import BudgetSchedule, Choice
from ddtree.settings import GenerationConfig
from telemetry import TelemetryConfig, start_telemetry
from telemetry.analysis.digest import Digest
from tests.helpers import random_prompts, tiny_pair

SCHEDULE = BudgetSchedule((Choice(1, "ddtree", 8), Choice(2, "ar"), Choice(4, "ddtree", 3)))


def test_step_lines_carry_each_steps_budget_and_requests_are_complete(tmp_path: Path) -> None:
    log = tmp_path / "auto.jsonl"
    config = TelemetryConfig(enabled=True, traces_exporter="none", metrics_exporter="none", log_file=str(log))
    telemetry = start_telemetry(config)
    try:
        target, drafter = tiny_pair(4, vocab=24)
        engine = Engine(target, drafter, observer=telemetry.observer)
        generation = GenerationConfig(method="ddtree", schedule=SCHEDULE, max_new_tokens=10)
        result = engine.stream(random_prompts(4, 8, vocab=24), generation, slots=3)  # steps of 3, 2 and 1 rows
    finally:
        telemetry.shutdown()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r.get("event") == "ddtree.step"]
    logged = Counter(b for s in steps for b in [s["budget"]] * len(s["request_ids"]))
    ran = Counter(b for o in result.outputs for b in o.budgets)
    assert logged == ran and len(ran) == 3, (logged, ran)
    assert all((s["method"] == "ar") == (s["budget"] == 0) for s in steps)
    requests = [r for r in records if r.get("event") == "ddtree.request"]
    assert len(requests) == 8 and all(r["budget"] is None for r in requests)
    digest = Digest.of(log.read_text().splitlines())
    completeness = digest.completeness()
    assert completeness.share == 1.0, completeness.line()
    assert {k[1] for k in digest.configs} == set(ran)
