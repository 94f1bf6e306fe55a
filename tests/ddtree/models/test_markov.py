"""The Markov head: saved beside a drafter and loaded with the pair; the trees it conditions keep decoding
exact (greedy tokens are ar's, sampled tokens follow the target's distribution)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ddtree.engine.engine import Engine
from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from ddtree.errors import UserError
from ddtree.models.markov import HEAD_NAME, MarkovHead, load_head, save_head
from ddtree.models.pair import conditioned
from ddtree.settings import GenerationConfig
from tests.ddtree.test_sampling import pooled_chisquare, target_probs
from tests.helpers import random_prompts, shape_of, tiny_pair


def _random_head(hidden: int, rank: int, seed: int, scale: float = 3.0) -> MarkovHead:
    head = MarkovHead(hidden, rank)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.parent.copy_(torch.randn(hidden, rank, generator=gen) * scale)
        head.child.copy_(torch.randn(hidden, rank, generator=gen) * scale)
    return head


def test_a_head_is_saved_beside_the_drafter_and_loaded_back(tmp_path: Path) -> None:
    head = _random_head(16, 4, 0)
    assert load_head(tmp_path, torch.device("cpu")) is None  # no head: the marginal tree
    path = save_head(head, tmp_path)
    assert path.name == HEAD_NAME
    loaded = load_head(tmp_path, torch.device("cpu"))
    assert loaded is not None and loaded.rank == 4
    assert torch.equal(loaded.parent, head.parent) and torch.equal(loaded.child, head.child)


def test_a_broken_or_mismatched_head_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / HEAD_NAME).write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="cannot load the Markov head"):
        load_head(tmp_path, torch.device("cpu"))
    target, _ = tiny_pair(0, vocab=16, hidden=32)
    with pytest.raises(UserError, match="16 wide, the target's embeddings 32"):
        conditioned(_random_head(16, 4, 0), target)
    with pytest.raises(ValueError, match="rank"):
        MarkovHead(16, 0)


@pytest.mark.parametrize("seed", range(3))
def test_conditioned_trees_keep_greedy_tokens_those_of_ar_and_change_what_is_drafted(seed: int) -> None:
    target, drafter = tiny_pair(seed, vocab=20, block_size=5)
    prompts = random_prompts(seed, 4, vocab=20)
    ar = Engine(target, drafter).generate(prompts, GenerationConfig(method="ar", max_new_tokens=24)).outputs
    config = GenerationConfig(method="ddtree", budget=8, max_new_tokens=24)
    marginal = Engine(target, drafter).generate(prompts, config).outputs
    drafter.transition = conditioned(_random_head(target.config.hidden_size, 4, seed), target)
    out = Engine(target, drafter).generate(prompts, config).outputs
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    assert [o.acceptance_lengths for o in out] != [o.acceptance_lengths for o in marginal], "the head drafts others"


def test_sampling_from_conditioned_trees_follows_the_targets_distribution() -> None:
    """At T=1 the first two tokens of requests decoded on conditioned trees follow the target's own joint
    distribution (chi-square, as `tests/ddtree/test_sampling.py` checks marginal trees)."""
    vocab, prompt, draws = 8, [1, 2, 3], 3000
    target, drafter = tiny_pair(11, vocab=vocab, block_size=4)
    drafter.transition = conditioned(_random_head(target.config.hidden_size, 4, 1), target)
    session = DecodeSession(target, drafter, shape_of("ddtree", 8, None, drafter), slots=draws, capacity=40)
    slots = session.join([Request(prompt, 2, temperature=1.0, seed=i) for i in range(draws)])
    while session.has_active():
        session.step()
    session.drain()
    outs = [session.leave(slot) for slot in slots]
    assert sum(a > 1 for o in outs for a in o.acceptance_lengths) > draws // 10, "drafts should be accepted"
    pairs = np.array([o.token_ids for o in outs])  # [draws, 2]
    p1 = target_probs(target, [prompt])[0]
    joint = p1[:, None] * target_probs(target, [[*prompt, a] for a in range(vocab)])
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    assert pooled_chisquare(counts.ravel(), joint.ravel()) > 1e-3
