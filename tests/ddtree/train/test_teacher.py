"""Teacher-forced acceptance (`ddtree.train.teacher`) equals real decoding step by step on tiny random pairs
in float64: the chain and trees of several budgets and top-k, end-of-sequence tokens and the token limit."""

from __future__ import annotations

import pytest

from ddtree.engine.engine import Engine, GenerationConfig
from ddtree.methods import get_method
from ddtree.train.teacher import Reply, acceptance_lengths, eval_shapes, greedy_replies, teacher_forced_tau, walk
from tests.helpers import random_prompts, tiny_hybrid_pair, tiny_pair

VOCAB = 12  # small, so that random drafts are often accepted and the walks take long steps too


@pytest.mark.parametrize(("seed", "limit", "eos"), [(0, 12, ()), (1, 9, (3,)), (2, 1, ())])
def test_teacher_forced_lengths_are_the_engines(seed: int, limit: int, eos: tuple[int, ...]) -> None:
    target, drafter = tiny_pair(seed, vocab=VOCAB, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(seed, 5, vocab=VOCAB)
    replies = greedy_replies(engine, prompts, limit, batch_size=3)
    assert all(len(r.tokens) == limit + drafter.depth for r in replies)
    shapes = eval_shapes([1, 3, 8], drafter.depth)
    shapes.append(get_method("ddtree").shape(6, 2, drafter.depth))  # top-k 2
    ours = acceptance_lengths(target, drafter, replies, shapes, eos)
    for shape in shapes:
        config = GenerationConfig(shape.method, shape.budget, shape.topk, max_new_tokens=limit, eos_token_ids=eos)
        decoded = [o.acceptance_lengths for o in engine.generate(prompts, config).outputs]
        assert ours[shape.label] == decoded, shape.label
    if limit > 1:
        assert any(n > 1 for runs in ours.values() for r in runs for n in r), "some steps accept drafts"


def test_hybrid_targets_too() -> None:
    target, drafter = tiny_hybrid_pair("qwen3_next", 0, vocab=VOCAB, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(4, 3, vocab=VOCAB)
    replies = greedy_replies(engine, prompts, 10)
    shapes = eval_shapes([4], drafter.depth)
    tau = teacher_forced_tau(target, drafter, replies, shapes, ())
    for shape in shapes:
        config = GenerationConfig(shape.method, shape.budget, shape.topk, max_new_tokens=10)
        lengths = [n for o in engine.generate(prompts, config).outputs for n in o.acceptance_lengths]
        assert tau[shape.label] == pytest.approx(sum(lengths) / len(lengths))


def test_the_walk_stops_at_the_end_of_sequence_and_the_limit() -> None:
    reply = Reply([1], [5, 6, 7, 8, 9, 10, 11, 12], limit=6)
    assert walk([0] * 6, reply, ()) == [1] * 5, "one token a step after the prefill's"
    assert walk([2, 0, 0, 0, 0, 0], reply, ()) == [3, 1, 1], "3 + 1 + 1 + 1 = 6 tokens"
    assert walk([4, 0, 0, 0, 0, 0], reply, ()) == [5], "a step past the limit is recorded whole"
    assert walk([2, 0, 0, 9, 0, 0], reply, (8,)) == [3], "the end-of-sequence token ends it"
    assert walk([1] * 6, Reply([1], [8, 1, 2], 6), (8,)) == [], "the prefill's token was the end"
