"""Training a Markov head: its samples are the drafter's teacher-forced candidates, its loss falls where the
next token depends on the one before, and a head's trees are measured teacher-forced as the engine decodes."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.engine import Engine
from ddtree.models.markov import MarkovHead
from ddtree.models.pair import conditioned
from ddtree.settings import GenerationConfig
from ddtree.train.data import TrainingSequence
from ddtree.train.markov import HeadSamples, head_loss, head_samples, replies_of, train_head
from ddtree.train.teacher import acceptance_lengths, eval_shapes, greedy_replies
from tests.helpers import random_prompts, tiny_pair

VOCAB = 12


def test_a_head_learns_a_next_token_that_its_parent_decides() -> None:
    """Candidates of equal marginal probability, the label a fixed function of the parent: a trained head
    ranks the label first, where the marginals alone leave it one of k."""
    gen = torch.Generator().manual_seed(0)
    vocab, hidden, k, n = 10, 16, 4, 2000
    embeddings = torch.randn(vocab, hidden, generator=gen)
    parent = torch.randint(vocab, (n,), generator=gen)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(n)])  # [n, k] distinct candidates
    rule = (parent * 3 + 1) % vocab  # the token that follows each parent
    ids[:, 0] = rule  # the label is a candidate, at a random place
    shuffle = torch.argsort(torch.rand(n, k, generator=gen), dim=-1)
    ids = ids.gather(1, shuffle)
    label = (ids == rule[:, None]).float().argmax(dim=-1)
    samples = HeadSamples(torch.full((n, k), -1.0), ids, parent, label)
    with torch.no_grad():
        untrained = head_loss(MarkovHead(hidden, 8), embeddings, samples)
    assert float(untrained) == pytest.approx(float(torch.log(torch.tensor(k))), rel=1e-4)  # the marginal tree's
    head = train_head(samples, embeddings, rank=8, steps=300, lr=3e-2, batch_size=512)
    with torch.no_grad():
        assert float(head_loss(head, embeddings, samples)) < 0.2 * float(untrained)


def test_the_head_kept_is_the_best_on_the_validation_samples_never_worse_than_none() -> None:
    """Validation samples that follow another rule than the training ones: training makes them worse, and the
    head kept is the marginal tree's (a zero parent factor), whose loss is the candidates' own."""
    gen = torch.Generator().manual_seed(1)
    vocab, hidden, k, n = 10, 16, 4, 1000
    embeddings = torch.randn(vocab, hidden, generator=gen)
    parent = torch.randint(vocab, (n,), generator=gen)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(n)])
    ids[:, 0] = (parent * 3 + 1) % vocab
    train = HeadSamples(torch.full((n, k), -1.0), ids, parent, torch.zeros(n, dtype=torch.long))
    contrary = HeadSamples(train.log_probs, ids, parent, torch.ones(n, dtype=torch.long))
    head = train_head(train, embeddings, rank=8, steps=100, lr=3e-2, batch_size=256, valid=contrary)
    assert bool((head.parent == 0).all()), "no check beat the marginal tree"
    kept = train_head(train, embeddings, rank=8, steps=100, lr=3e-2, batch_size=256, valid=train)
    with torch.no_grad():
        assert float(head_loss(kept, embeddings, train)) < 0.5 * float(torch.log(torch.tensor(k)))


def test_head_samples_are_the_drafters_candidates_and_the_targets_tokens() -> None:
    target, drafter = tiny_pair(0, vocab=VOCAB, block_size=5)
    prompts = random_prompts(0, 4, vocab=VOCAB)
    replies = greedy_replies(Engine(target, drafter), prompts, 10, drafter.depth)
    sequences = [TrainingSequence(r.prompt + r.tokens, len(r.prompt)) for r in replies]
    again = replies_of(sequences, drafter.depth)
    assert [r.limit for r in again] == [len(r.tokens) - drafter.depth - 1 for r in replies]
    samples = head_samples(target, drafter, again, k=4)
    assert samples.ids.shape == (len(samples), 4) and samples.log_probs.shape == (len(samples), 4)
    assert 0 < len(samples) <= sum(r.limit for r in again) * (drafter.depth - 1)
    assert bool((samples.log_probs[:, :-1] >= samples.log_probs[:, 1:]).all()), "candidates best first"
    assert bool((samples.label >= 0).all() and (samples.label < 4).all())
    head = train_head(samples, target.embed_tokens.weight, rank=4, steps=60, lr=1e-2)
    with torch.no_grad():
        assert float(head_loss(head, target.embed_tokens.weight.float(), samples)) < float(
            head_loss(MarkovHead(target.config.hidden_size, 4), target.embed_tokens.weight.float(), samples)
        )


@pytest.mark.parametrize("seed", range(2))
def test_teacher_forced_lengths_with_a_head_are_the_engines(seed: int) -> None:
    target, drafter = tiny_pair(seed, vocab=VOCAB, block_size=5)
    head = MarkovHead(target.config.hidden_size, 4)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.parent.copy_(torch.randn(head.parent.shape, generator=gen) * 3)
        head.child.copy_(torch.randn(head.child.shape, generator=gen) * 3)
    drafter.transition = conditioned(head, target)
    engine = Engine(target, drafter)
    prompts = random_prompts(seed, 4, vocab=VOCAB)
    replies = greedy_replies(engine, prompts, 12, drafter.depth)
    shapes = eval_shapes([3, 8], drafter.depth, chain=False)
    ours = acceptance_lengths(target, drafter, replies, shapes, ())
    for shape in shapes:
        config = GenerationConfig(shape.method, shape.budget, shape.topk, max_new_tokens=12)
        assert ours[shape.label] == [o.acceptance_lengths for o in engine.generate(prompts, config).outputs]
