"""`ddtree advise LOG --cost-curve FILE --schedule OUT`: a budget schedule planned from the replay of a logged
run of a tiny pair, written where `read_schedule` reads it back; and its errors."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from ddtree.cli.main import main
from ddtree.engine.engine import Engine
from ddtree.schedule import read_schedule
from ddtree.settings import GenerationConfig
from telemetry.analysis.advise import MIN_EXACT_SHARE, advise
from telemetry.analysis.cost import CostPoint, read_costs, write_costs
from telemetry.analysis.digest import Digest
from telemetry.analysis.schedule import plan_schedule
from telemetry.collector import Collector
from telemetry.config import TelemetryConfig
from telemetry.logging import LogSink, make_logger
from tests.helpers import random_prompts, tiny_pair


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A greedy log of ddtree B=16 on four requests, node detail on every step (as tests/telemetry/analysis/
    test_report.py writes its logs)."""
    stream = io.StringIO()
    sink = LogSink(make_logger(TelemetryConfig(), stream), tree_share=1.0)
    engine = Engine(*tiny_pair(3, vocab=12, block_size=5), observer=Collector([sink], "cpu"))
    engine.generate(random_prompts(3, 4, vocab=12), GenerationConfig(budget=16, max_new_tokens=20))
    path = tmp_path_factory.mktemp("log") / "steps.jsonl"
    path.write_text(stream.getvalue())
    return path


def _cost_file(path: Path, temperature: float = 0.0, ar: bool = True) -> Path:
    """Flat at one row (the largest replayed tau wins), steep at 64 (ar wins); a bogus measured tau of 9 that
    a greedy plan with a log must not use."""
    points = [CostPoint(1, "ddtree", b, 1.0, tau=9.0) for b in (1, 16)]
    points += [CostPoint(64, "ddtree", b, 10.0 * b, tau=9.0) for b in (1, 16)]
    if ar:
        points += [CostPoint(1, "ar", None, 1.0), CostPoint(64, "ar", None, 1.0)]
    write_costs(path, points, temperature)
    return path


def _digest(path: Path) -> Digest:
    with path.open() as stream:
        return Digest.of(stream)


def test_advise_writes_the_replayed_schedule_that_read_schedule_reads_back(
    log: Path, tmp_path: Path, capsys: Any
) -> None:
    cost, out = _cost_file(tmp_path / "cost.json"), tmp_path / "sched" / "schedule.json"
    assert main(["advise", str(log), "--cost-curve", str(cost), "--schedule", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = plan_schedule(read_costs(cost), _digest(log))
    assert "replayed from ddtree B=16 in the log" in plan.source and not plan.estimates
    assert plan.table() in printed and f"wrote the schedule to {out}" in printed

    one, many = plan.schedule.choices
    advice = advise(_digest(log), read_costs(cost).curves[1])  # priced at the logged load, flat: max tau
    trusted = [c for c in advice["configs"] if c["exact_share"] >= MIN_EXACT_SHARE]
    assert one.method == "ddtree" and one.predicted_tokens_per_second == pytest.approx(
        max(c["predicted_tau"] for c in trusted) * 1000
    )
    assert (one.predicted_tokens_per_second or 0.0) < 9.0 * 1000  # the replay's tau, not the cost file's
    assert many.method == "ar" and many.predicted_tokens_per_second == pytest.approx(64_000)

    back = read_schedule(out)
    assert [(c.batch_size, c.method, c.budget, c.topk) for c in back.choices] == [
        (c.batch_size, c.method, c.budget, c.topk) for c in plan.schedule.choices
    ]
    for read, planned in zip(back.choices, plan.schedule.choices, strict=True):
        assert read.predicted_tokens_per_second == pytest.approx(planned.predicted_tokens_per_second, abs=0.05)
        assert read.gain_over_ar == pytest.approx(planned.gain_over_ar, abs=5e-4)


def test_advise_json_carries_the_plan_and_a_temperature_plan_is_estimates(
    log: Path, tmp_path: Path, capsys: Any
) -> None:
    cost, out = _cost_file(tmp_path / "cost.json", temperature=0.7), tmp_path / "schedule.json"
    assert main(["advise", str(log), "--cost-curve", str(cost), "--schedule", str(out), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["schedule"]
    assert plan["estimates"] and "T=0.7" in plan["source"]
    assert [r["batch_size"] for r in plan["rows"]] == [1, 64]
    assert plan["rows"][0]["predicted_tokens_per_second"] == pytest.approx(9.0 * 1000)  # measured tau, flat curve
    assert [c.method for c in read_schedule(out).choices] == ["ddtree", "ar"]


def test_schedule_without_a_cost_curve_or_without_ar_times_exits_2(log: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "schedule.json"
    assert main(["advise", str(log), "--schedule", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--schedule needs --cost-curve" in err and len(err.splitlines()) == 1
    cost = _cost_file(tmp_path / "cost.json", ar=False)
    assert main(["advise", str(log), "--cost-curve", str(cost), "--schedule", str(out)]) == 2
    captured = capsys.readouterr()
    assert "no batch size of the cost file has ar's step time" in captured.err and len(captured.err.splitlines()) == 1
    assert captured.out == "" and not out.exists()


def test_advise_replays_the_adaptive_width_at_each_batch_size_of_the_cost_file(
    log: Path, tmp_path: Path, capsys: Any
) -> None:
    cost = _cost_file(tmp_path / "cost.json")
    assert main(["advise", str(log), "--cost-curve", str(cost), "--json"]) == 0
    adaptive = json.loads(capsys.readouterr().out)["adaptive"]
    assert adaptive["widths"] == [1, 2, 4, 8, 16]
    by_rows = {entry["rows"]: entry["predicted"] for entry in adaptive["by_rows"]}
    assert set(by_rows) == {None, 1, 64} and by_rows[1]["steps"] > 0
    # One row: every width costs 1 ms as ar does, so the widest tree, which predicts the most, runs every step.
    assert by_rows[1]["chosen_widths"] == {"16": by_rows[1]["steps"]}
    assert by_rows[1]["adaptive_tokens_per_second"] == pytest.approx(by_rows[1]["fixed_tokens_per_second"]["16"])
    # 64 rows: a tree costs 10 ms a node and ar 1 ms: ar, at 64 tokens a step.
    assert by_rows[64]["chosen_widths"] == {"0": by_rows[64]["steps"]}
    assert by_rows[64]["adaptive_tokens_per_second"] == pytest.approx(64_000)
    assert main(["advise", str(log), "--cost-curve", str(cost)]) == 0
    assert "adaptive width per step (of [1, 2, 4, 8, 16] and ar)" in capsys.readouterr().out
