"""A session whose budget follows the load (`ddtree.schedule`): switching between trees and plain `ar` rows
between steps never changes a request's tokens, and warm-up runs every shape a step can take."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree.engine.engine import Engine
from ddtree.engine.requests import Request, row_counts
from ddtree.engine.session import DecodeSession
from ddtree.methods import TreeShape
from ddtree.schedule import BudgetSchedule, Choice
from ddtree.settings import GenerationConfig
from tests.helpers import random_prompts, tiny_pair


def _schedule(*choices: tuple[int, int | None, int | None]) -> BudgetSchedule:
    return BudgetSchedule(
        tuple(Choice(rows, "ar" if budget is None else "ddtree", budget, topk) for rows, budget, topk in choices)
    )


MIXED = _schedule((1, 24, None), (2, None, None), (4, 3, 2), (8, 9, None))


def _pair(seed: int, vocab: int = 24, block_size: int = 6) -> Engine:
    """On the device of `DDTREE_TEST_DEVICE` (`tiny_pair`'s): on CUDA with graphs, as served."""
    target, drafter = tiny_pair(seed, vocab=vocab, block_size=block_size)
    return Engine(target, drafter)


def test_the_session_runs_the_shape_scheduled_for_its_row_bucket() -> None:
    engine = _pair(0)
    config = GenerationConfig(method="ddtree", schedule=MIXED, max_new_tokens=12)
    prompts = random_prompts(0, 8, vocab=24)
    ar = engine.generate(prompts, GenerationConfig(method="ar", max_new_tokens=12))
    for slots in (1, 2, 3, 8):
        out = engine.stream(prompts, config, slots=slots)
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ar.outputs], slots
        used = {b for o in out.outputs for b in o.budgets}
        expected = {MIXED.choice_for(n).budget or 0 for n in row_counts(slots)}  # the step's row buckets
        assert used <= expected and (MIXED.choice_for(slots).budget or 0) in used, (slots, used)
        assert all(len(o.budgets) == len(o.acceptance_lengths) for o in out.outputs)
    alone = engine.stream(prompts, config, slots=1)
    assert all(set(o.budgets) == {24} for o in alone.outputs)
    assert any(a > 1 for o in alone.outputs for a in o.acceptance_lengths), "drafts should be accepted"
    paired = engine.stream(prompts, config, slots=2)
    assert 0 in {b for o in paired.outputs for b in o.budgets}, "two active requests run ar rows"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    slots=st.integers(1, 5),
    budgets=st.lists(st.one_of(st.none(), st.integers(1, 40)), min_size=1, max_size=4),
    topk=st.one_of(st.none(), st.integers(1, 4)),
)
def test_greedy_output_is_ar_whatever_the_load_did(
    seed: int, slots: int, budgets: list[int | None], topk: int | None
) -> None:
    """Requests join and leave a session whose tree changes with the load: each request's tokens are ar's."""
    engine = _pair(seed % 7, block_size=4 + seed % 4)
    schedule = _schedule(*((1 << i, b, topk if b else None) for i, b in enumerate(budgets)))
    prompts = random_prompts(seed, 6, vocab=24, low=1, high=10)
    new = 8 + seed % 9
    ar = engine.generate(prompts, GenerationConfig(method="ar", max_new_tokens=new))
    out = engine.stream(prompts, GenerationConfig(method="ddtree", schedule=schedule, max_new_tokens=new), slots)
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ar.outputs]


def test_ar_steps_keep_feeding_the_drafter() -> None:
    """Between tree steps the drafter's cache must take every accepted token's features, ar steps' too:
    after each step it holds the target's committed prefix but for the last step's accepted path."""
    engine = _pair(5)
    session = engine.session(GenerationConfig(method="ddtree", schedule=MIXED), 4, 128)
    assert session.draft_cache is not None
    # slot 2 ends first, then slot 1: steps over 4 rows (B=3), 2 rows (ar), then 1 row (B=24)
    prompts = random_prompts(5, 3, vocab=24)
    slots = session.join([Request(p, n) for p, n in zip(prompts, (24, 16, 8), strict=True)])
    budgets: set[int] = set()
    while session.has_active():
        session.step()
        for slot in slots:
            if not session.output(slot).finished:
                lag = session.cache.lengths[slot] - session.draft_cache.lengths[slot]
                assert int(lag) == int(session.counts[slot]) > 0
        budgets |= {b for slot in slots for b in session.output(slot).budgets}
    assert {0, 3, 24} <= budgets, budgets


def test_warm_up_runs_every_shape_the_schedule_can_take() -> None:
    engine = _pair(1)
    target, drafter = engine.target, engine.drafter
    shapes = engine.shapes(GenerationConfig(method="ddtree", schedule=MIXED))
    session = DecodeSession(target, drafter, shapes, slots=5, capacity=256)
    session.warm_up(prompt_tokens=4, new_tokens=3)
    warmed = {(shape, key[0]) for shape, runner in session.runners.items() for key in runner.shapes}
    for n in row_counts(5):
        assert (shapes.shape_for(n), n) in warmed, (shapes.shape_for(n).label, n)
    before = {(shape, key[0]) for shape, runner in session.runners.items() for key in runner.shapes}
    prompts = random_prompts(4, 9, vocab=24)
    pending = [Request(p, 6) for p in prompts]
    while pending or session.has_active():
        free = session.free_slots()
        if pending and free:
            session.join([pending.pop() for _ in range(min(len(free), len(pending), 1 + len(pending) % 3))])
        session.step()
        for slot, entry in enumerate(session.slots):
            if entry is not None and entry.output.finished:
                session.leave(slot)
    after = {(shape, key[0]) for shape, runner in session.runners.items() for key in runner.shapes}
    assert after == before, "no (shape, rows) pair is new after warm-up"


def test_a_schedule_needs_the_ddtree_method() -> None:
    engine = _pair(2)
    with pytest.raises(ValueError, match="budget schedule"):
        engine.generate([[1, 2]], GenerationConfig(method="dflash", schedule=MIXED))


def test_a_fixed_session_reports_its_budget_and_a_switching_one_reports_none() -> None:
    engine = _pair(2)
    fixed = engine.session(GenerationConfig(method="ddtree", budget=5), 2, 64)
    switching = engine.session(GenerationConfig(method="ddtree", schedule=MIXED), 2, 64)
    request = Request([1, 2, 3], 4)
    assert fixed._info(request, 0).budget == 5
    assert switching._info(request, 0).budget is None
    assert isinstance(switching.shape, TreeShape) and switching.shape.budget == 24
