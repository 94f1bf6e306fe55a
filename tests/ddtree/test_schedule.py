"""`ddtree.schedule`: the nearest measured load, the file format and its errors, and the shapes a session
takes from a schedule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree.methods import TreeShape, get_method
from ddtree.schedule import BudgetSchedule, Choice, ShapeSchedule, nearest, read_schedule, write_schedule

SCHEDULE = BudgetSchedule(
    (Choice(16, "ddtree", 8, 2, 900.0, 1.4), Choice(1, "ddtree", 64), Choice(64, "ar"), Choice(4, "ddtree", 32)),
    {"model": "m", "drafter": "d", "device": "NVIDIA H200", "dtype": "bfloat16"},
)


def _shape(method: str, budget: int, topk: int | None) -> TreeShape:
    return get_method(method).shape(budget, topk, 15)


@pytest.mark.parametrize(
    ("rows", "size"), [(0, 1), (1, 1), (2, 1), (3, 4), (4, 4), (6, 4), (8, 4), (9, 16), (31, 16), (33, 64), (500, 64)]
)
def test_the_nearest_load_on_a_log_scale_ties_to_the_smaller(rows: int, size: int) -> None:
    assert nearest([64, 1, 16, 4], rows) == size
    assert SCHEDULE.choice_for(rows).batch_size == size


def test_choices_are_sorted_and_labelled() -> None:
    assert [c.batch_size for c in SCHEDULE.choices] == [1, 4, 16, 64]
    assert [c.label for c in SCHEDULE.choices] == ["ddtree B=64", "ddtree B=32", "ddtree B=8 k=2", "ar"]
    table = SCHEDULE.table()
    assert "ddtree B=8 k=2" in table and "1.40x" in table and len(table.splitlines()) == 5


def test_a_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "schedule.json"
    write_schedule(path, SCHEDULE)
    back = read_schedule(path)
    assert back.choices == SCHEDULE.choices and dict(back.tuned_for) == dict(SCHEDULE.tuned_for)
    assert json.loads(path.read_text())["format"] == "ddtree.schedule/1"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"format": "ddtree.cost/2", "choices": []}', "format 'ddtree.cost/2'"),
        ('{"format": "ddtree.schedule/1", "choices": []}', "at least one choice"),
        ('{"format": "ddtree.schedule/1", "choices": [{"batch_size": 1, "method": "dflash"}]}', "ar and ddtree"),
        ('{"format": "ddtree.schedule/1", "choices": [{"batch_size": 1, "method": "ddtree"}]}', "budget must be >= 1"),
        ('{"format": "ddtree.schedule/1", "choices": [{"batch_size": 0, "method": "ar"}]}', "must be >= 1"),
        (
            '{"format": "ddtree.schedule/1", "choices": [{"batch_size": 2, "method": "ar"}, '
            '{"batch_size": 2, "method": "ar"}]}',
            "distinct",
        ),
        ("not json", "is not a budget schedule"),
    ],
)
def test_bad_files_are_errors_that_name_the_file(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"s\.json") as caught:
        read_schedule(path)
    assert words in str(caught.value)
    with pytest.raises(ValueError, match="cannot read the schedule"):
        read_schedule(tmp_path / "missing.json")


def test_mismatch_names_what_differs() -> None:
    same = dict(SCHEDULE.tuned_for)
    assert SCHEDULE.mismatch(same) is None
    assert SCHEDULE.mismatch({**same, "device": "cpu"}) == "device 'NVIDIA H200', not 'cpu'"
    assert BudgetSchedule((Choice(1, "ar"),)).mismatch(same) is None, "a schedule tuned for nothing fits all"


def test_the_shapes_a_session_takes() -> None:
    shapes = SCHEDULE.resolve(_shape)
    assert shapes.widest.budget == 64 and shapes.switching
    assert [s.budget for s in shapes.shapes] == [64, 32, 8, 0]
    assert [shapes.shape_for(n).budget for n in (1, 2, 3, 4, 16, 32, 64)] == [64, 64, 32, 32, 8, 8, 0]
    fixed = ShapeSchedule.fixed(_shape("ddtree", 16, None))
    assert not fixed.switching and fixed.shape_for(40).budget == 16
