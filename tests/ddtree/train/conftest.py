"""Tiny training set-ups shared by the tests of `ddtree.train`: in memory, float32, a few seconds at most."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ddtree.models.dflash import DFlashDrafter
from ddtree.train.data import TrainingSequence, generate_responses
from tests.helpers import random_prompts, tiny_pair

VOCAB = 16
BLOCK = 4


@pytest.fixture(scope="module")
def tiny_data() -> list[TrainingSequence]:
    """A tiny random target's greedy responses to 24 random prompts."""
    target, _ = tiny_pair(1, vocab=VOCAB)
    prompts = random_prompts(1, 24, vocab=VOCAB, low=2, high=6)
    return generate_responses(target, prompts, max_new_tokens=24, eos_token_ids=(), batch_size=8, quiet=True)


@pytest.fixture
def fresh() -> Callable[[], tuple[torch.nn.Module, DFlashDrafter]]:
    """A new (HF target model, drafter) pair, the same on every call: what a new process would build."""

    def make() -> tuple[torch.nn.Module, DFlashDrafter]:
        target, drafter = tiny_pair(1, vocab=VOCAB, block_size=BLOCK)
        return target.model.float(), drafter.float()

    return make


class FakeClock:
    """Seconds that advance by one at every reading: the trainer reads once per run and once per step."""

    def __init__(self) -> None:
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def fake_clock() -> type[FakeClock]:
    """The class of `FakeClock`: one new clock per run, as a new process would start its own."""
    return FakeClock
