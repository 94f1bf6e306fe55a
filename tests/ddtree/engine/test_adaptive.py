"""Adaptive sessions: whatever width each step verifies, greedy tokens are ar's and sampling stays seeded; the
choice follows the measured costs; a replayed step verifies the tree its own first part drafted."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from ddtree.adaptive import adaptive_widths
from ddtree.engine import adaptive as adaptive_steps
from ddtree.engine import graphs
from ddtree.engine.adaptive import (
    CALIBRATE_EVERY,
    COST_WEIGHT,
    EXPLORE_EVERY,
    RECALIBRATE_EVERY,
    CapSteps,
    Decision,
    Observed,
)
from ddtree.engine.engine import Engine
from ddtree.engine.graphs import GraphCache, StepRunner, _Captured
from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from ddtree.schedule import ShapeSchedule
from ddtree.settings import GenerationConfig
from tests.ddtree.test_sampling import pooled_chisquare, target_probs
from tests.helpers import random_prompts, shape_of, tiny_pair


def _session(target: Any, drafter: Any, budget: int, slots: int, depth: int = 1, **kw: Any) -> DecodeSession:
    shape = ShapeSchedule.up_to(shape_of("ddtree", budget, None, drafter))
    return DecodeSession(target, drafter, shape, slots=slots, capacity=200, pipeline_depth=depth, **kw)


def _stream(session: DecodeSession, requests: list[Request], pick: Any) -> list[Any]:
    """Requests join as slots free up, every other step; `pick(step)` forces each step's width (None: its
    own choice). Returns the outputs in request order."""
    waiting = list(enumerate(requests))
    held: dict[int, int] = {}
    done: dict[int, Any] = {}
    steps = 0
    while waiting or held:
        if waiting and session.free_slots() and steps % 2 == 0:
            index, request = waiting.pop(0)
            held[session.join([request])[0]] = index
        if session.has_active():
            assert session.adaptive is not None
            session.adaptive.forced = pick(steps)
            session.step()
        steps += 1
        for slot in [s for s in held if session.output(s).finished]:
            done[held.pop(slot)] = session.leave(slot)
    session.drain()
    return [done[i] for i in range(len(requests))]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("depth", [1, 2])
def test_random_widths_joins_and_leaves_keep_greedy_tokens_those_of_ar(seed: int, depth: int) -> None:
    target, drafter = tiny_pair(seed, vocab=20, block_size=4 + seed % 3)
    budget = [3, 8, 13][seed % 3]
    prompts = random_prompts(seed, 5, vocab=20)
    news = [9 + 5 * i for i in range(5)]
    ar = Engine(target, drafter).generate(prompts, GenerationConfig(method="ar", max_new_tokens=max(news)))
    rng = random.Random(seed)
    session = _session(target, drafter, budget, slots=3, depth=depth)
    outs = _stream(
        session, [Request(p, n) for p, n in zip(prompts, news, strict=True)], lambda _: rng.randint(0, budget)
    )
    for out, alone, n in zip(outs, ar.outputs, news, strict=True):
        assert out.token_ids == alone.token_ids[:n]
    widths = {b for o in outs for b in o.budgets}
    assert len(widths) > 3, "the steps should have verified many widths"
    assert any(a > 1 for o in outs for a in o.acceptance_lengths), "drafts should be accepted"


def test_seeded_sampling_is_the_same_at_any_width_sequence_it_is_given_again() -> None:
    """At T > 0 a request's draws are seeded: the same widths give the same tokens, alone or batched."""
    target, drafter = tiny_pair(3, vocab=16, block_size=5)
    prompts = random_prompts(3, 4, vocab=16)
    requests = [Request(p, 20, temperature=0.9, seed=7 + i) for i, p in enumerate(prompts)]
    rng = random.Random(1)
    widths = [rng.randint(0, 8) for _ in range(400)]
    batched = _stream(_session(target, drafter, 8, slots=4), requests, lambda step: widths[step])
    again = _stream(_session(target, drafter, 8, slots=4), requests, lambda step: widths[step])
    assert [o.token_ids for o in batched] == [o.token_ids for o in again]


def test_the_choice_follows_the_measured_costs() -> None:
    target, drafter = tiny_pair(5, vocab=16, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(5, 2, vocab=16)
    config = GenerationConfig(method="ddtree", budget=8, adaptive=True, max_new_tokens=12)
    first = engine.generate(prompts, config)
    session = next(s for s in engine.sessions.values() if s.adaptive is not None)
    adaptive = session.adaptive
    assert adaptive is not None and set(adaptive.caps) == {4, 8}
    for cap, steps in adaptive.caps.items():  # every cap's widths, timed at every row count
        assert set(steps.costs) == {1, 2} and steps.widths == adaptive_widths(cap)
        assert all(bool((c > 0).all()) and c.shape == (len(steps.widths),) for c in steps.costs.values())
    assert all(len(o.gains) == len(o.budgets) == len(o.acceptance_lengths) for o in first.outputs)
    for rows in (1, 2):  # ar costs nothing: every step verifies the root alone
        for cap, width in adaptive.pairs():
            adaptive.set_cost(rows, cap, width, 1e-9 if width == 0 else 1.0)
    ar_only = engine.generate(prompts, config)
    assert {b for o in ar_only.outputs for b in o.budgets} == {0}
    assert all(a == 1 for o in ar_only.outputs for a in o.acceptance_lengths)
    for rows in (1, 2):  # every width costs the same: the widest of the step's cap predicts the most
        for cap, width in adaptive.pairs():
            adaptive.set_cost(rows, cap, width, 1.0)
    widest = engine.generate(prompts, config)
    assert {b for o in widest.outputs for b in o.budgets} <= {4, 8}
    assert [o.token_ids for o in widest.outputs] == [o.token_ids for o in ar_only.outputs]


def test_measuring_costs_needs_an_adaptive_empty_session() -> None:
    target, drafter = tiny_pair(2, vocab=16, block_size=4)
    fixed = DecodeSession(target, drafter, shape_of("ddtree", 4, None, drafter), slots=1, capacity=100)
    with pytest.raises(ValueError, match="adaptive"):
        fixed.measure_costs()
    session = _session(target, drafter, 4, slots=2)
    slot = session.join([Request([1, 2], 5)])[0]  # the first join measures
    assert session.adaptive is not None and set(session.adaptive.caps[4].costs) == {1, 2}
    assert session.adaptive.fixed_costs == {}  # on the CPU the host's wait costs a step nothing
    session.leave(slot)
    session.measure_costs(repeats=1, unwaited=True)
    fixed = session.adaptive.fixed_costs  # each width's fixed step also timed, without a decision
    assert set(fixed) == {1, 2} and all(set(c) == {0, 1, 2, 4} and min(c.values()) > 0 for c in fixed.values())
    slot = session.join([Request([1, 2], 5)])[0]
    with pytest.raises(ValueError, match="empty"):
        session.measure_costs()
    session.leave(slot)


class _Replay:
    """A stand-in CUDA graph: replaying runs its stages' Python again on the state it was captured on (which,
    like a graph's static buffers, is all it reads)."""

    def __init__(self, group: list[Any], state: Any) -> None:
        self.group, self.state = group, state

    def replay(self) -> None:
        for stage in self.group:
            stage(self.state)


def _fake_capture(self: StepRunner[Any], state: Any) -> _Captured[Any]:
    """Capture without CUDA: each graph's stages, recorded on the state the graphs own, not run now."""
    return _Captured([_Replay(group, state) for group in self._groups()], state, self.per_stage)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_replayed_step_verifies_the_tree_its_own_first_part_drafted(
    monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """With graphs, the second part replays on the first part's captured state: its acceptance lengths are the
    eager session's, step for step (a second part reading a stale tree would verify the wrong drafts)."""
    monkeypatch.setattr(StepRunner, "_capture", _fake_capture)
    monkeypatch.setattr(graphs, "require_cuda", lambda device: None)
    monkeypatch.setattr("ddtree.engine.session.require_cuda", lambda device: None)
    monkeypatch.setattr(DecodeSession, "few_shapes", property(lambda self: True))  # as on CUDA: steps share keys
    target, drafter = tiny_pair(0, vocab=8, block_size=5)
    prompts = random_prompts(0, 3, vocab=8)
    rng = random.Random(2)
    widths = [rng.choice([1, 2, 4, 8]) for _ in range(400)]  # a key's first step drafts (width 0 reads no tree)

    def run(graphed: bool) -> list[Any]:
        session = _session(target, drafter, 8, slots=2, depth=depth, cuda_graphs=graphed, fused=False)
        session._prefills = GraphCache(False)  # the prefill's graphs are not what this test is about
        assert session.adaptive is not None
        session.adaptive.measured = True  # no dummy steps first: each key's first step is a real one, of any width
        return _stream(session, [Request(p, 24) for p in prompts], lambda step: widths[step])

    eager, replayed = run(False), run(True)
    assert [o.acceptance_lengths for o in replayed] == [o.acceptance_lengths for o in eager]
    assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]
    assert sum(a > 1 for o in eager for a in o.acceptance_lengths) > 5, "drafts should be accepted"


def test_the_session_calibrates_its_prediction_from_what_the_target_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adaptive_steps, "commitment", lambda *_: None)  # every step decides: the calibration sees all
    target, drafter = tiny_pair(0, vocab=8, block_size=5)
    engine = Engine(target, drafter)
    config = GenerationConfig(method="ddtree", budget=8, adaptive=True, max_new_tokens=40)
    out = engine.generate(random_prompts(0, 2, vocab=8), config)
    session = next(s for s in engine.sessions.values() if s.adaptive is not None)
    assert session.adaptive is not None and sum(len(o.budgets) for o in out.outputs) >= RECALIBRATE_EVERY
    seen = session.adaptive.calibration
    accepted = sum(a - 1 for o in out.outputs for a in o.acceptance_lengths)
    assert sum(seen.accepted) == accepted and sum(seen.predicted) > 0 and seen.steps >= RECALIBRATE_EVERY
    assert seen.scale.tolist() != [1.0] * len(seen.widths)  # sent to the device
    expected = seen.expected(2)  # the row count's mean curve, calibrated, within each width
    assert all(e is None or 0 <= e <= w for e, w in zip(expected, seen.widths, strict=True))


def test_a_row_count_drafts_the_cap_whose_best_width_pays_most() -> None:
    """Where drafting the widest tree costs every width more, the row count's steps soon draft a narrower one:
    their widths stay within it (but for the widest draft every `EXPLORE_EVERY` steps)."""
    target, drafter = tiny_pair(0, vocab=8, block_size=5)
    session = _session(target, drafter, 8, slots=1)
    adaptive = session.adaptive
    assert adaptive is not None
    adaptive.measured = True
    for cap, width in adaptive.pairs():
        adaptive.set_cost(1, cap, width, 1.0 if cap == 4 else 10.0)
    out = _stream(session, [Request([1, 2, 3], 80)], lambda _: None)[0]
    assert adaptive.cap_of[1] == 4 and len(out.budgets) > RECALIBRATE_EVERY + 4
    later = out.budgets[RECALIBRATE_EVERY + 1 :]
    assert all(b <= 4 for i, b in enumerate(later, RECALIBRATE_EVERY + 1) if i % EXPLORE_EVERY)
    assert max(out.budgets[:RECALIBRATE_EVERY]) == 8  # the first steps draft the widest tree


def test_sampling_at_random_widths_follows_the_targets_distribution() -> None:
    """At T=1 with each step's width drawn at random, the first two tokens follow the target's own joint
    distribution (chi-square, as `tests/ddtree/test_sampling.py` checks fixed trees)."""
    vocab, prompt, draws = 8, [1, 2, 3], 3000
    target, drafter = tiny_pair(11, vocab=vocab, block_size=4)
    session = _session(target, drafter, 8, slots=draws)
    assert session.adaptive is not None
    session.adaptive.measured = True
    rng = random.Random(5)
    outs = _stream_all(session, [Request(prompt, 2, temperature=1.0, seed=i) for i in range(draws)], rng)
    pairs = np.array([o.token_ids for o in outs])  # [draws, 2]
    assert sum(a > 1 for o in outs for a in o.acceptance_lengths) > draws // 10, "drafts should be accepted"
    p1 = target_probs(target, [prompt])[0]
    joint = p1[:, None] * target_probs(target, [[*prompt, a] for a in range(vocab)])
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    assert pooled_chisquare(counts.ravel(), joint.ravel()) > 1e-3
    assert pooled_chisquare(counts.ravel(), np.full(vocab * vocab, 1 / vocab**2)) < 1e-3  # the test has power


def _stream_all(session: DecodeSession, requests: list[Request], rng: random.Random) -> list[Any]:
    """All `requests` joined at once, each step at a random width (0 to the widest)."""
    slots = session.join(requests)
    assert session.adaptive is not None
    while session.has_active():
        session.adaptive.forced = rng.randint(0, 8)
        session.step()
    session.drain()
    return [session.leave(slot) for slot in slots]


def test_a_steady_steps_time_moves_its_cost_and_an_outlier_does_not() -> None:
    target, drafter = tiny_pair(0, vocab=8, block_size=5)
    session = _session(target, drafter, 8, slots=1)
    adaptive = session.adaptive
    assert adaptive is not None
    adaptive.set_cost(1, 8, 4, 1.0)
    seen = Observed(rows=1, cap=8, index=adaptive.caps[8].widths.index(4), raw=1.0, active=1.0, curve=[0.0] * 5)
    waited = Decision(1, 8, adaptive.caps[8].widths, 4, own=True)
    adaptive.timed(waited, seen, 2.0)
    assert adaptive.caps[8].seconds[1][seen.index] == pytest.approx(1.0 + COST_WEIGHT)
    assert adaptive.caps[8].costs[1][seen.index].item() == pytest.approx(1.0 + COST_WEIGHT)  # the device's too
    adaptive.timed(waited, seen, 50.0)  # a step that carried a join's prefill or a capture
    assert adaptive.caps[8].seconds[1][seen.index] == pytest.approx(1.0 + COST_WEIGHT)
    adaptive.fixed_costs[1][4] = 1.0
    adaptive.timed(Decision(1, 8, (), 4, own=True, preset=1.5), None, 0.5)  # a committed row count's fixed step
    assert adaptive.fixed_costs[1][4] == pytest.approx(1.0 - 0.5 * COST_WEIGHT)
    assert adaptive.caps[8].seconds[1][seen.index] == pytest.approx(1.0 + COST_WEIGHT)


def test_a_row_count_whose_window_chose_one_width_runs_its_fixed_step_and_stays_lossless(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once every decision of a window chose the same width, the row count's steps run that width's fixed step
    (no decision), but for every `CALIBRATE_EVERY`-th, which decides without waiting (read later, with the
    tokens); the commitment holds window after window, and the tokens stay ar's."""
    target, drafter = tiny_pair(0, vocab=8, block_size=5)
    shape = ShapeSchedule.up_to(shape_of("ddtree", 8, None, drafter))
    session = DecodeSession(target, drafter, shape, slots=1, capacity=500)
    adaptive = session.adaptive
    assert adaptive is not None
    adaptive.measured = True
    for cap, width in adaptive.pairs():  # the widest tree is the cheapest: every decision chooses it
        adaptive.set_cost(1, cap, width, 1.0 if (cap, width) == (8, 8) else 10.0)
    adaptive.fixed_costs[1] = {w: 20.0 for w in adaptive.widths}  # measured slower than deciding: never believed
    waited, decided = [], []
    read, run = CapSteps._read, CapSteps.run
    monkeypatch.setattr(CapSteps, "_read", lambda self, state: waited.append(1) or read(self, state))
    monkeypatch.setattr(CapSteps, "run", lambda self, *a: decided.append(1) or run(self, *a))
    prompt = [1, 2, 3]
    out = _stream(session, [Request(prompt, 400)], lambda _: None)[0]
    ar = Engine(target, drafter).generate([prompt], GenerationConfig(method="ar", max_new_tokens=400))
    assert out.token_ids == ar.outputs[0].token_ids
    steps = len(out.budgets)
    assert steps > RECALIBRATE_EVERY * (CALIBRATE_EVERY + 1), "the commitment should be judged again"
    assert adaptive.committed[1][:2] == (8, 8)
    assert len(waited) == RECALIBRATE_EVERY  # only the first window's steps waited for their decision
    assert abs(len(decided) - (RECALIBRATE_EVERY + (steps - RECALIBRATE_EVERY) / CALIBRATE_EVERY)) <= 2
    assert len(out.gains) == len(out.budgets) and set(out.budgets) == {8}


@pytest.mark.parametrize("seed", range(3))
def test_committed_widths_fixed_steps_joins_and_leaves_keep_greedy_tokens_those_of_ar(seed: int) -> None:
    """Row counts committed to widths (ar's among them: its fixed step still feeds the drafter) run fixed
    steps between deciding ones as requests join and leave; greedy tokens stay ar's."""
    target, drafter = tiny_pair(seed, vocab=20, block_size=5)
    prompts = random_prompts(seed, 6, vocab=20)
    news = [20 + 7 * i for i in range(6)]
    ar = Engine(target, drafter).generate(prompts, GenerationConfig(method="ar", max_new_tokens=max(news)))
    session = _session(target, drafter, 8, slots=4, depth=1 + seed % 2)
    adaptive = session.adaptive
    assert adaptive is not None
    adaptive.measured = True
    rng = random.Random(seed)
    for rows in (1, 2):
        adaptive.committed[rows] = (8, rng.choice([0, 2]), 1.0)
    adaptive.committed[4] = (8, 8, 1.0)
    outs = _stream(session, [Request(p, n) for p, n in zip(prompts, news, strict=True)], lambda _: None)
    for out, alone, n in zip(outs, ar.outputs, news, strict=True):
        assert out.token_ids == alone.token_ids[:n]
    assert any(a > 1 for o in outs for a in o.acceptance_lengths), "drafts should be accepted"


def test_a_window_whose_choices_varied_commits_only_where_the_wait_costs_more_than_deciding_gains() -> None:
    target, drafter = tiny_pair(0, vocab=8, block_size=5)
    adaptive = _session(target, drafter, 8, slots=1).adaptive
    assert adaptive is not None
    steps = adaptive.caps[8]
    widths = steps.widths
    for width in widths:
        adaptive.set_cost(1, 8, width, 1.0)
    adaptive.committed[1] = (8, 8, 1.0)
    gains = [[1.0] + [2.0 if w == (4 if i % 2 else 8) else 1.5 for w in widths[1:]] for i in range(RECALIBRATE_EVERY)]
    window = [Observed(1, 8, 0, 0.0, 1.0, [0.0] * len(widths), g) for g in gains]  # widths 4 and 8 in turn
    for seen in window:
        adaptive.observe(seen, 0)
    assert adaptive.committed == {}  # deciding made 2x ar, either width alone 1.75x
    for width in widths:
        adaptive.fixed_costs[1][width] = 0.5  # the wait and the decision double a step
    for seen in window:
        adaptive.observe(seen, 0)
    _, width, gain = adaptive.committed[1]
    assert width in (4, 8) and gain == pytest.approx(1.75)  # the window's mean gain at that width
