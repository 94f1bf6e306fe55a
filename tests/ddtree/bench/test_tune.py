from __future__ import annotations

from pathlib import Path

from ddtree.bench.tune import FILL, Kept, TuneSettings, cost_curves, filled
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


def test_kept_cost_runs_resume_and_a_changed_setting_measures_again(tmp_path: Path) -> None:
    target, drafter = tiny_pair(3, vocab=24)
    seen = _Rows()
    engine = Engine(target, drafter, observer=seen)
    prompts = random_prompts(3, 2, vocab=24)
    settings = TuneSettings(budgets=(2, 3), batch_sizes=(1, 2), max_new_tokens=4)

    def steps() -> int:
        count = sum(len(rows) for rows in seen.rows.values())
        seen.rows.clear()
        return count

    kept = Kept.of(tmp_path, prompts, settings, {"pair": "tiny"})
    first = cost_curves(engine, prompts, (), settings, tmp_path / "a.json", kept=kept)
    everything = steps()
    assert everything > 0
    assert cost_curves(engine, prompts, (), settings, tmp_path / "b.json", kept=kept).curves.keys() == {1, 2}
    assert steps() == 0, "a finished run is taken whole"
    (tmp_path / "tune-costs-b2.json").unlink()  # as if the run had stopped before batch size 2 was kept
    again = cost_curves(engine, prompts, (), settings, tmp_path / "c.json", kept=kept)
    assert 0 < steps() < everything, "only the batch size not kept is measured"
    assert again.curves[1].points == first.curves[1].points and again.ar_step_ms[1] == first.ar_step_ms[1]
    other = Kept.of(tmp_path, prompts, TuneSettings(budgets=(2, 3), batch_sizes=(1, 2), max_new_tokens=5), {})
    cost_curves(engine, prompts, (), settings, tmp_path / "d.json", kept=other)
    assert steps() == everything, "what other settings made is not taken"
    assert not kept.log_finished()
    kept.log.write_text("")
    assert not kept.log_finished(), "a log without its finished mark is not taken"
    kept.finish_log()
    assert kept.log_finished() and not other.log_finished()
