"""Teacher-forced acceptance (`ddtree.train.teacher`) equals real decoding step by step on tiny random pairs
in float64: the chain and trees of several budgets and top-k, end-of-sequence tokens and the token limit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddtree.engine.engine import Engine
from ddtree.methods import get_method
from ddtree.models.dflash import DFlashDrafter
from ddtree.models.hybrid import make_target
from ddtree.settings import GenerationConfig
from ddtree.train.data import TrainingSequence
from ddtree.train.runs import tau_points
from ddtree.train.teacher import (
    Reply,
    acceptance_lengths,
    chain_depth_counts,
    eval_shapes,
    greedy_replies,
    teacher_forced_tau,
    top_k_coverage,
    walk,
)
from ddtree.train.trainer import TrainConfig, train
from tests.ddtree.train.conftest import FakeClock
from tests.helpers import random_prompts, tiny_hybrid_pair, tiny_pair

VOCAB = 12  # small, so that random drafts are often accepted and the walks take long steps too


@pytest.mark.parametrize(("seed", "limit", "eos"), [(0, 12, ()), (1, 9, (3,)), (2, 1, ())])
def test_teacher_forced_lengths_are_the_engines(seed: int, limit: int, eos: tuple[int, ...]) -> None:
    target, drafter = tiny_pair(seed, vocab=VOCAB, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(seed, 5, vocab=VOCAB)
    replies = greedy_replies(engine, prompts, limit, drafter.depth, batch_size=3)
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
    replies = greedy_replies(engine, prompts, 10, drafter.depth)
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


def test_training_curves_evaluate_outside_the_training_time(
    tmp_path: Path,
    tiny_data: list[TrainingSequence],
    fresh: Callable[[], tuple[torch.nn.Module, DFlashDrafter]],
    fake_clock: type[FakeClock],
) -> None:
    """`eval_every_seconds`: teacher-forced tau every that much training time and at the end, in the run's
    record; the training itself (weights, its time) is what it is without the evaluations."""
    config = TrainConfig(steps=9, batch_size=4, anchors=4, warmup=2, eval_every_seconds=3.0)
    model, plain = fresh()
    alone = train(plain, model, tiny_data, tmp_path / "a", config, quiet=True, clock=fake_clock())
    model, drafter = fresh()
    target = make_target(model, feature_layers=drafter.target_layer_ids)
    prompts = [s.ids[: s.prompt_len] for s in tiny_data[:3]]
    replies = greedy_replies(Engine(target, None), prompts, 8, drafter.depth)
    shapes = eval_shapes([4], drafter.depth)

    def evaluate(current: DFlashDrafter) -> dict[str, float]:
        return {k: v for k, v in teacher_forced_tau(target, current, replies, shapes, ()).items() if v is not None}

    report = train(drafter, model, tiny_data, tmp_path / "b", config, quiet=True, clock=fake_clock(), evaluate=evaluate)
    assert report["wall_seconds"] == alone["wall_seconds"], "evaluations take no training time"
    for key, value in plain.state_dict().items():
        assert torch.equal(value, drafter.state_dict()[key]), key
    evals = json.loads((tmp_path / "b" / "runs.json").read_text())[-1]["evals"]
    assert [e["step"] for e in evals] == [3, 6, 9] and [e["seconds"] for e in evals] == [3.0, 6.0, 9.0]
    assert evals[-1]["tau"] == evaluate(drafter.eval()) and set(evals[0]["tau"]) == {"dflash", "ddtree B=4"}
    assert tau_points([{"evals": evals, "eval": {"tau": {"dflash": 9.0}}, "cumulative_seconds": 9}])["dflash"] == [
        (e["seconds"] / 60, e["tau"]["dflash"]) for e in evals
    ], "the curve takes the run's evaluations, not its end-of-run one twice"


def _one_hot(tokens: list[list[int]], vocab: int = 5) -> torch.Tensor:
    """Logits `[n, depth, vocab]` whose argmax is `tokens`."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def test_chain_depth_counts_stop_at_the_first_miss() -> None:
    truth = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [4, 4, 4]])  # [n, depth]
    drafts = [[1, 2, 3], [1, 0, 3], [0, 2, 3], [4, 4, 0]]  # all, one then a miss (a later match no longer counts)
    reached, matched = chain_depth_counts(_one_hot(drafts), truth)
    assert reached.tolist() == [4, 3, 2] and matched.tolist() == [3, 2, 1]


def test_top_k_coverage_counts_each_step_once_from_its_rank_on() -> None:
    logits = torch.tensor([[5.0, 4, 3, 2, 1], [1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])  # [n, vocab]
    truth = torch.tensor([0, 3, 2])  # ranks 1, 2 and 3
    assert top_k_coverage(logits, truth, 4).tolist() == [1, 2, 3, 3]
