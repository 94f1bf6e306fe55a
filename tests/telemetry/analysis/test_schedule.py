"""`plan_schedule` on hand-built cost files whose right answer is known: the step times of docs/benchmarks.md's
H200 table at batch 1 and 16, and a batch 64 where every tree is slower than ar."""

from __future__ import annotations

import pytest

from telemetry.analysis.cost import CostFile, cost_curve
from telemetry.analysis.digest import Digest
from telemetry.analysis.schedule import MARGIN, plan_schedule

TAU = {4: 2.18, 16: 2.72, 64: 3.07}
STEP_MS = {  # batch size -> (ar ms, {budget: ms})
    1: (1.53, {4: 2.00, 16: 2.11, 64: 2.25}),
    16: (1.72, {4: 2.16, 16: 2.44, 64: 2.99}),
    64: (1.00, {4: 2.50, 16: 3.50, 64: 6.00}),
}


def _costs(
    step_ms: dict[int, tuple[float, dict[int, float]]] = STEP_MS,
    tau: dict[int, float] = TAU,
    temperature: float | None = None,
) -> CostFile:
    return CostFile(
        {b: cost_curve(list(ms.items()), f"test at batch size {b}") for b, (_, ms) in step_ms.items()},
        {b: ar for b, (ar, _) in step_ms.items()},
        {b: dict(tau) for b in step_ms},
        temperature,
    )


def _speed(batch: int, budget: int) -> float:
    return batch * TAU[budget] / STEP_MS[batch][1][budget] * 1000


def test_a_big_tree_at_one_row_a_small_one_at_16_and_ar_where_every_tree_is_slower() -> None:
    plan = plan_schedule(_costs(), tuned_for={"model": "m", "device": "d"})
    choices = {c.batch_size: c for c in plan.schedule.choices}
    assert [(c.method, c.budget, c.topk) for c in choices.values()] == [
        ("ddtree", 64, None),
        ("ddtree", 16, None),
        ("ar", None, None),
    ]
    assert choices[1].predicted_tokens_per_second == pytest.approx(_speed(1, 64))
    assert choices[1].gain_over_ar == pytest.approx(_speed(1, 64) / (1 / 1.53 * 1000))
    assert choices[64].predicted_tokens_per_second == pytest.approx(64 / 1.00 * 1000)
    assert choices[64].gain_over_ar == 1.0
    assert plan.schedule.tuned_for == {"model": "m", "device": "d"}
    assert not plan.estimates and "measured in the cost file" in plan.source


def test_the_best_single_budget_is_best_relative_to_each_batch_sizes_best_tree() -> None:
    plan = plan_schedule(_costs())
    relative = {budget: sum(_speed(b, budget) / max(_speed(b, x) for x in TAU) for b in STEP_MS) for budget in TAU}
    assert max(relative, key=relative.__getitem__) == 16  # not 64, the best at one row, nor 4, at 64 rows
    assert plan.single == (16, None)
    rows = {r.choice.batch_size: r for r in plan.rows}
    assert rows[1].gain_over_single == pytest.approx(_speed(1, 64) / _speed(1, 16))
    assert rows[16].gain_over_single == pytest.approx(1.0)
    assert rows[64].gain_over_single == pytest.approx(64_000 / _speed(64, 16))
    assert rows[64].best_tree == (4, None) and rows[64].best_tree_gain < 1


def test_the_margin_keeps_ar_when_a_tree_is_only_one_percent_faster() -> None:
    ar_ms = 4.0 * 1.01 / TAU[4]  # ddtree B=4 at 4 ms makes 1% more tokens/s than ar
    costs = _costs({8: (ar_ms, {4: 4.0, 16: 100.0})}, {4: TAU[4], 16: TAU[16]})
    (kept,) = plan_schedule(costs).schedule.choices
    assert MARGIN > 1.01 and kept.method == "ar"
    (tree,) = plan_schedule(costs, margin=1.0).schedule.choices
    assert (tree.method, tree.budget) == ("ddtree", 4) and tree.gain_over_ar == pytest.approx(1.01)
    with pytest.raises(ValueError, match="margin"):
        plan_schedule(costs, margin=0.9)


def test_at_a_temperature_the_measured_tau_is_used_and_the_plan_says_estimates() -> None:
    plan = plan_schedule(_costs(temperature=0.7), Digest())  # a log, but at T > 0 it is not replayed
    assert plan.estimates and "T=0.7" in plan.source
    assert [c.budget for c in plan.schedule.choices] == [64, 16, None]
    table = plan.table()
    assert "estimates" in table.splitlines()[0] and "T=0.7" in table.splitlines()[0]
    assert "estimates" not in plan_schedule(_costs()).table()


def test_the_table_has_a_line_for_each_batch_size() -> None:
    table = plan_schedule(_costs()).table()
    rows = [line.split() for line in table.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["1", "16", "64"]
    assert rows[0][1:3] == ["ddtree", "B=64"] and rows[2][1] == "ar"
    assert "tau: measured in the cost file" in table and "best single budget: ddtree B=16" in table
    assert "vs ddtree B=16" in table


def test_missing_tau_or_ar_times_raise_value_errors() -> None:
    costs = _costs(temperature=0.7)
    del costs.tau[16]
    with pytest.raises(ValueError, match=r"no tau at batch sizes \[16\].*T=0.7, not replayed"):
        plan_schedule(costs)
    with pytest.raises(ValueError, match=r"no tau at batch sizes \[16\].*no log"):
        plan_schedule(CostFile(costs.curves, costs.ar_step_ms, costs.tau, 0.0), Digest())
    no_ar = CostFile(costs.curves, {}, costs.tau)
    with pytest.raises(ValueError, match="no batch size of the cost file has ar's step time"):
        plan_schedule(no_ar)


def test_a_batch_size_without_ar_is_left_out_and_said_so() -> None:
    costs = _costs()
    del costs.ar_step_ms[16]
    plan = plan_schedule(costs)
    assert [c.batch_size for c in plan.schedule.choices] == [1, 64]
    assert any("batch size 16 has no ar step time" in w for w in plan.warnings)
