"""Which steps the session tells its observer are warm-up: the first step of each shape, where a session that
compiles per shape or captures graphs does that work, and no step of one that does neither."""

from __future__ import annotations

from typing import Any

import pytest

from ddtree.engine.engine import Engine, GenerationConfig
from ddtree.engine.graphs import StepRunner
from ddtree.engine.session import DecodeSession
from ddtree.methods import TreeShape
from ddtree.observer import NoopObserver
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
