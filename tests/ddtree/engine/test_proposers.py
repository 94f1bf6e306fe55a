"""The drafter proposer: it drafts only the depths its tree can reach, and builds the tree all depths give."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from ddtree.tree import DraftTree, build_tree
from tests.helpers import random_prompts, shape_of, tiny_pair


@pytest.mark.parametrize(("budget", "depth"), [(2, 2), (4, 4), (9, 5)])
def test_the_tree_is_the_one_every_drafted_depth_would_give(budget: int, depth: int) -> None:
    """Block size 6 drafts 5 depths; budget 2 reaches 2 of them and budget 9 all 5. Each step's tree must equal
    the tree built from the head's logits at every depth."""
    target, drafter = tiny_pair(11, vocab=12, block_size=6)
    session = DecodeSession(target, drafter, shape_of("ddtree", budget, None, drafter), slots=3, capacity=96)
    hidden_seen: list[torch.Tensor] = []
    built: list[tuple[torch.Tensor, DraftTree]] = []
    forward, build = drafter.forward, session.proposer.build

    def record_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        hidden = forward(*args, **kwargs)
        hidden_seen.append(hidden)
        return hidden

    def record_build(logits: torch.Tensor, batch: int) -> DraftTree:
        tree = build(logits, batch)
        built.append((logits, tree))
        return tree

    drafter.forward = record_forward  # type: ignore[method-assign]
    session.proposer.build = record_build  # type: ignore[method-assign]
    session.join([Request(p, 16) for p in random_prompts(4, 3, vocab=12)])
    for _ in range(4):
        session.step()
    assert len(built) == 4 and len(hidden_seen) >= 4
    for hidden, (logits, tree) in zip(hidden_seen[-4:], built, strict=True):
        every_depth = target.head(hidden[:, 1:])  # [batch, 5, vocab]
        assert every_depth.shape[1] == 5 and logits.shape[1] == depth
        reference = build_tree(every_depth, budget)
        assert int(tree.num_nodes.min()) == budget, "a full tree, so the check compares real nodes"
        for field in ("tokens", "parents", "depths", "num_nodes"):
            assert torch.equal(getattr(tree, field), getattr(reference, field)), field
        torch.testing.assert_close(tree.log_probs, reference.log_probs)
