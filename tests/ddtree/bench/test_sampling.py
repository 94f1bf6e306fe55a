"""`run_bench` at a temperature and seed (`Sampling`), and its `auto` row on a budget schedule."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest

from ddtree.bench.rows import AUTO, BenchRow, Sampling, run_bench
from ddtree.engine import engine as engine_module
from ddtree.engine.engine import Engine
from ddtree.schedule import BudgetSchedule, Choice, ShapeSchedule
from ddtree.settings import GenerationConfig
from tests.helpers import random_prompts, tiny_pair

METHODS = ["ar", "dflash", "ddtree"]


def _bench(engine: Engine, prompts: list[list[int]], **kwargs: Any) -> list[BenchRow]:
    return run_bench(engine, prompts, [4], 8, 2, kwargs.pop("methods", METHODS), (), **kwargs)


def _figures(rows: list[BenchRow]) -> list[tuple[object, ...]]:
    return [(r.label, r.tau, r.steps, r.new_tokens, r.token_ids) for r in rows]


def test_the_seed_decides_every_rows_samples() -> None:
    """One seed twice: the same tokens and tau in every row; another seed: other tokens in every row."""
    target, drafter = tiny_pair(3)
    engine = Engine(target, drafter)
    prompts = random_prompts(5, 5, 32)
    first = _bench(engine, prompts, sampling=Sampling(1.0, 3))
    again = _bench(engine, prompts, sampling=Sampling(1.0, 3))
    other = _bench(engine, prompts, sampling=Sampling(1.0, 4))
    greedy = _bench(engine, prompts)
    assert _figures(first) == _figures(again)
    assert all(a.token_ids != b.token_ids for a, b in zip(first, other, strict=True)), "every row samples"
    assert all(a.token_ids != g.token_ids for a, g in zip(first, greedy, strict=True)), "not greedy"
    assert all(r.tau is not None and r.tau >= 1 for r in first)


def test_temperature_zero_is_greedy_whatever_the_seed() -> None:
    target, drafter = tiny_pair(3)
    engine = Engine(target, drafter)
    prompts = random_prompts(5, 5, 32)
    default = _bench(engine, prompts)
    seeded = _bench(engine, prompts, sampling=Sampling(0.0, 9))
    assert _figures(default) == _figures(seeded)
    assert all(r.token_ids == default[0].token_ids for r in default), "greedy: every row emits ar's tokens"


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_prompt_i_samples_with_seed_plus_i_in_any_batch(method: str) -> None:
    """Static batches of two and continuous slots give each prompt the tokens it gets alone with seed + i."""
    target, drafter = tiny_pair(3)
    engine = Engine(target, drafter)
    prompts = random_prompts(7, 5, 32)
    sampling = Sampling(0.9, 11)
    static = _bench(engine, prompts, methods=[method], sampling=sampling)[0]
    streamed = _bench(engine, prompts, methods=[method], sampling=sampling, continuous=True)[0]
    alone = [
        tuple(
            Engine(target, drafter)
            .generate([p], GenerationConfig(method=method, budget=4, temperature=0.9, seed=11 + i, max_new_tokens=8))
            .outputs[0]
            .token_ids
        )
        for i, p in enumerate(prompts)
    ]
    assert static.token_ids == streamed.token_ids == tuple(alone)


@pytest.mark.parametrize(
    ("temperature", "seed", "message"),
    [
        (-0.5, 0, "temperature must be a finite number >= 0, got -0.5"),
        (math.nan, 0, "temperature must be a finite number >= 0, got nan"),
        (math.inf, 0, "temperature must be a finite number >= 0, got inf"),
        (1.0, -1, "seed must be >= 0, got -1"),
    ],
)
def test_bad_sampling_is_a_value_error(temperature: float, seed: int, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        Sampling(temperature, seed)


def test_the_hf_row_refuses_to_sample() -> None:
    target, drafter = tiny_pair(3)
    message = "HF generate's row decodes greedily only; temperature must be 0, got 0.5"
    with pytest.raises(ValueError, match=re.escape(message)):
        _bench(Engine(target, drafter), random_prompts(1, 2, 32), baseline=True, sampling=Sampling(0.5))


def test_a_one_choice_schedule_row_equals_that_budgets_row() -> None:
    """`auto` on a schedule of ddtree B=4 alone is the ddtree B=4 row again, after it, at a temperature too."""
    target, drafter = tiny_pair(3)
    engine = Engine(target, drafter)
    prompts = random_prompts(5, 5, 32)
    schedule = BudgetSchedule((Choice(1, "ddtree", 4),))
    for sampling in (Sampling(), Sampling(0.8, 2)):
        rows = _bench(engine, prompts, methods=["ddtree", "ar"], sampling=sampling, schedule=schedule)
        assert [r.label for r in rows] == ["ddtree B=4", AUTO, "ar"], "beside the ddtree rows"
        auto = rows[1]
        assert (auto.method, auto.budget) == (AUTO, None)
        assert _figures([auto])[0][1:] == _figures(rows[:1])[0][1:]


def test_the_auto_row_switches_trees_and_runs_without_ddtree_in_the_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    """A schedule of two budgets: the auto row's session gets the whole schedule to switch on; greedy, it
    emits ar's tokens, and it runs where the methods are ar alone."""
    made: list[object] = []
    real = engine_module.DecodeSession

    def spy(*args: Any, **kwargs: Any) -> Any:
        made.append(args[2])  # the shape, or the shape schedule of a switching session
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "DecodeSession", spy)
    target, drafter = tiny_pair(3)
    schedule = BudgetSchedule((Choice(1, "ddtree", 8), Choice(2, "ddtree", 2)))
    rows = _bench(Engine(target, drafter), random_prompts(5, 5, 32), methods=["ar"], schedule=schedule)
    assert [r.label for r in rows] == ["ar", AUTO]
    assert rows[1].token_ids == rows[0].token_ids
    assert rows[1].tau is not None and rows[1].tau > 1.0
    switching = [s for s in made if isinstance(s, ShapeSchedule)]
    assert switching and {shape.budget for shape in switching[0].shapes} == {8, 2}
