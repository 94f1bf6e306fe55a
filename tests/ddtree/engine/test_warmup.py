"""Which steps the session tells its observer are warm-up: the first step of each shape, where a session that
compiles per shape or captures graphs does that work, and no step of one that does neither."""

from __future__ import annotations

from typing import Any

import pytest

from ddtree.engine.engine import Engine
from ddtree.engine.graphs import StepRunner
from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from ddtree.methods import TreeShape
from ddtree.observer import NoopObserver
from ddtree.settings import GenerationConfig
from tests.helpers import random_prompts, tiny_pair


class StepStarts(NoopObserver):
    def __init__(self) -> None:
        self.starts: list[tuple[int, int, bool]] = []  # (step, rows, warmup)

    def on_step_start(self, step: int, batch_size: int, warmup: bool = False, shape: TreeShape | None = None) -> None:
        self.starts.append((step, batch_size, warmup))


def _run(observer: StepStarts) -> None:
    target, drafter = tiny_pair(3, vocab=16)
    config = GenerationConfig(budget=6, max_new_tokens=24)
    engine = Engine(target, drafter, observer=observer, cuda_graphs="off")  # eager on any device
    engine.generate(random_prompts(3, 3, vocab=16, high=6), config)


def test_an_eager_session_has_no_warmup_steps() -> None:
    observer = StepStarts()
    _run(observer)
    assert observer.starts and not any(warmup for _, _, warmup in observer.starts)


def test_the_first_step_of_each_shape_is_warmup_where_shapes_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step's shape (rows, key span, sampled) as the step runner sees it: a step is warm-up exactly when
    no step of its shape ran before."""
    monkeypatch.setattr(DecodeSession, "compiles_per_shape", property(lambda self: True))
    keys: list[tuple[object, ...]] = []
    run = StepRunner.run

    def recording(self: StepRunner[Any], key: tuple[object, ...], make: Any) -> Any:
        keys.append(key)
        return run(self, key, make)

    monkeypatch.setattr(StepRunner, "run", recording)
    monkeypatch.setattr(DecodeSession, "few_shapes", property(lambda self: True))  # spans in buckets, as on a GPU
    observer = StepStarts()
    _run(observer)
    assert len(keys) == len(observer.starts)
    expected = [key not in keys[:i] for i, key in enumerate(keys)]
    assert [warmup for _, _, warmup in observer.starts] == expected
    assert expected[0] and not all(expected), "the first step compiles; a later one replays"


def test_warm_up_makes_every_kind_of_step_so_serving_makes_none() -> None:
    """After `warm_up`, requests that sample, filter and ask for log-probabilities, alone and mixed, at any
    row count, run only steps of kinds warm-up made (each kind's graph is captured before the server listens)."""
    target, drafter = tiny_pair(3, vocab=16)
    engine = Engine(target, drafter)
    session = engine.session(GenerationConfig(budget=6), 3, 128)
    session.warm_up(prompt_tokens=4, new_tokens=3)
    warmed = {key[:1] + key[2:] for key in session.runner.shapes}  # (rows, sampled, filtered, scored); the span aside
    assert {key[1:] for key in warmed} == {(s, f, sc) for s, f in ((0, 0), (1, 0), (1, 1)) for sc in (0, 1)}
    kinds = [
        {},
        {"temperature": 0.8},
        {"temperature": 0.8, "top_k": 3},
        {"logprobs": 2},
        {"top_p": 0.5, "temperature": 1.2, "logprobs": 0},
    ]
    prompts = random_prompts(5, 7, vocab=16)
    pending = [Request(p, 5, seed=i, **kinds[i % len(kinds)]) for i, p in enumerate(prompts)]
    while pending or session.has_active():
        free = session.free_slots()
        if pending and free:
            session.join([pending.pop() for _ in range(min(len(free), len(pending)))])
        session.step()
        for slot, entry in enumerate(session.slots):
            if entry is not None and entry.output.finished:
                session.leave(slot)
    assert {key[:1] + key[2:] for key in session.runner.shapes} == warmed
