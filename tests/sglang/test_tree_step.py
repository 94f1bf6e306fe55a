"""The DDTREE step's tensor work (pure torch: runs without SGLang)."""

from __future__ import annotations

import pytest
import torch

from ddtree.sglang.tree_step import (
    accept_tree,
    commit,
    draft_tree,
    full_mask,
    kv_moves,
    path_columns,
    sample_nodes,
    tree_links,
    tree_verify,
)


def _random_verify(seed: int, bs: int = 3, depth: int = 5, vocab: int = 7, budget: int = 9, topk: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn((bs, depth, vocab), generator=gen) * 3
    tree = draft_tree(logits, budget, topk)
    bonus = torch.randint(0, vocab, (bs,), generator=gen)
    prefix = torch.randint(0, 6, (bs,), generator=gen)
    return tree_verify(tree, bonus, prefix), gen


@pytest.mark.parametrize("seed", range(5))
def test_links_are_first_child_and_next_sibling(seed: int) -> None:
    verify, _ = _random_verify(seed, topk=3)
    parents = verify.tree.parents
    first, sibling = tree_links(parents)
    for b in range(parents.shape[0]):
        p = parents[b].tolist()
        for i in range(len(p)):
            children = [j for j in range(len(p)) if p[j] == i]
            assert first[b, i].item() == (min(children) if children else -1)
            later = [j for j in range(i + 1, len(p)) if p[i] >= 0 and p[j] == p[i]]
            assert sibling[b, i].item() == (min(later) if later else -1)


def test_verify_inputs_root_positions_and_padding() -> None:
    # top-k 1 and budget 9 over depth 5: a chain of 5 nodes and 4 padding slots
    verify, _ = _random_verify(0, topk=1)
    tree = verify.tree
    assert (tree.num_nodes == 5).all()
    assert (verify.tokens[:, 0] == verify.tokens[:, -1]).all(), "padding repeats the root token"
    assert (verify.positions == verify.positions[:, :1] + tree.depths).all()
    pad = ~tree.valid
    assert (verify.ancestors[pad].sum(dim=-1) == 1).all(), "a padding slot sees only itself"


def test_full_mask_layout() -> None:
    verify, _ = _random_verify(1)
    prefixes = [0, 3, 5]
    mask = full_mask(verify.ancestors, prefixes)
    n = verify.width
    assert mask.numel() == sum(n * (p + n) for p in prefixes)
    offset = 0
    for b, p in enumerate(prefixes):
        block = mask[offset : offset + n * (p + n)].view(n, p + n)
        assert block[:, :p].all()
        assert torch.equal(block[:, p:], verify.ancestors[b])
        offset += n * (p + n)


@pytest.mark.parametrize("seed", range(5))
def test_commit_and_kv_moves_follow_the_accepted_path(seed: int) -> None:
    verify, gen = _random_verify(seed, bs=4)
    n, bs = verify.width, verify.tokens.shape[0]
    # The target agrees with a random node's path, then picks a random bonus.
    target = torch.randint(0, 7, (bs, n), generator=gen)
    for b in range(bs):
        node = int(torch.randint(0, int(verify.tree.num_nodes[b]) + 1, (1,), generator=gen))
        while node > 0:
            parent = int(verify.tree.parents[b, node])
            target[b, parent] = verify.tree.tokens[b, node]
            node = parent
    result = accept_tree(verify, target)
    step = commit(result, stride=6)
    window = torch.arange(bs * n).view(bs, n) * 10 + 100  # distinct slots per node
    buf = torch.arange(2000)
    tgt, src = kv_moves(window, result.path, result.accepted)
    buf[tgt] = buf[src].clone()
    for b in range(bs):
        acc = int(result.accepted[b])
        path = result.path[b, : acc + 1].tolist()
        drafts = [int(verify.tree.tokens[b, i]) for i in path[1:]]
        assert step.out_tokens[b, : acc + 1].tolist() == [*drafts, int(target[b, path[-1]])]
        assert int(step.commit_lens[b]) == acc + 1
        assert buf[window[b, : acc + 1]].tolist() == window[b, path].tolist(), "the path's KV leads the window"


def test_path_columns_cuts_and_pads() -> None:
    path = torch.tensor([[0, 2, 5, 5]])
    assert path_columns(path, 2).tolist() == [[0, 2]]
    assert path_columns(path, 6).tolist() == [[0, 2, 5, 5, 5, 5]]


def test_sampling_is_greedy_at_zero_temperature_and_respects_top_k() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn((2, 4, 50), generator=gen)
    zero = torch.zeros(2)
    assert torch.equal(sample_nodes(logits, zero, torch.full((2,), -1), torch.ones(2)), logits.argmax(-1))
    hot = torch.ones(2)
    top2 = logits.topk(2, dim=-1).indices
    for _ in range(20):
        drawn = sample_nodes(logits, hot, torch.full((2,), 2), torch.ones(2), generator=gen)
        assert ((drawn[..., None] == top2).any(-1)).all()
    drawn = {
        tuple(sample_nodes(logits, hot, torch.full((2,), -1), torch.ones(2), generator=gen).flatten().tolist())
        for _ in range(5)
    }
    assert len(drawn) > 1, "T = 1 without top-k never varied"
