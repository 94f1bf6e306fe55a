from __future__ import annotations

from pathlib import Path

from ddtree.bench.tune import FILL, TuneSettings, cost_curves, filled
from ddtree.engine.engine import Engine
from ddtree.methods import TreeShape
from ddtree.observer import NoopObserver
from tests.helpers import random_prompts, tiny_pair


class _Rows(NoopObserver):
    """The row count of every step that ran, per budget."""

    def __init__(self) -> None:
        self.rows: dict[int, list[int]] = {}

    def on_step_start(self, step: int, batch_size: int, warmup: bool = False, shape: TreeShape | None = None) -> None:
        self.rows.setdefault(shape.budget if shape else -1, []).append(batch_size)


def test_filled_repeats_the_prompts_in_order() -> None:
    prompts = [[1], [2], [3]]
    assert filled(prompts, 2) == [[1], [2], [3], [1], [2], [3], [1], [2]]
    assert len(filled(prompts, 5)) == FILL * 5
    many = [[i] for i in range(20)]
    assert filled(many, 2) == many, "enough prompts are left as they are"


def test_a_cost_point_is_a_step_over_its_batch_size(tmp_path: Path) -> None:
    """Two prompts, batch size 4: the cost runs still step over 4 rows (a drained batch of 2 would measure a
    smaller step and pass it off as the cost at 4)."""
    target, drafter = tiny_pair(3, vocab=24)
    seen = _Rows()
    engine = Engine(target, drafter, observer=seen)
    settings = TuneSettings(budgets=(2, 3), batch_sizes=(4,), max_new_tokens=6)
    costs = cost_curves(engine, random_prompts(2, 2, vocab=24), (), settings, tmp_path / "costs.json")
    assert sorted(costs.curves) == [4]
    for budget in (0, 2, 3):  # ar and the trees
        rows = seen.rows[budget]
        assert max(rows) == 4 and rows.count(4) > len(rows) / 2, (budget, rows)
