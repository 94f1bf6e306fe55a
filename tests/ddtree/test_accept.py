from __future__ import annotations

import pytest
import torch

from ddtree.accept import accept, accepted_ranks
from ddtree.tree import ancestor_mask, build_tree


def walk_reference(tokens: list[int], parents: list[int], n: int, choice: list[int]) -> tuple[list[int], int]:
    """Follow the target's token from the root while it names a child of the current node."""
    path, cur = [0], 0
    while True:
        nxt = [j for j in range(1, n + 1) if parents[j] == cur and tokens[j] == choice[cur]]
        if not nxt:
            return path, choice[cur]
        cur = nxt[0]
        path.append(cur)


@pytest.mark.parametrize("seed", range(30))
def test_ancestor_mask_and_accept_match_a_python_walk(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, depth, vocab, budget = 3, 5, 4, [1, 5, 16, 40][seed % 4]
    tree = build_tree(torch.randn(batch, depth, vocab, generator=gen) * 2, budget)
    anc = ancestor_mask(tree)
    for b in range(batch):
        parents = tree.parents[b].tolist()
        for i in range(tree.width):
            expect = {i}
            j = parents[i]
            while j >= 0:
                expect.add(j)
                j = parents[j]
            assert set(torch.nonzero(anc[b, i]).flatten().tolist()) == expect
    # Target choices: mostly follow the tree so that long paths occur.
    choice = torch.randint(0, vocab, (batch, tree.width), generator=gen)
    follow = torch.rand(batch, tree.width, generator=gen) < 0.7
    child_tok = torch.zeros_like(choice)
    for b in range(batch):
        for j in range(int(tree.num_nodes[b]), 0, -1):  # the most probable child wins (lowest index)
            child_tok[b, tree.parents[b, j]] = tree.tokens[b, j]
    choice = torch.where(follow, child_tok, choice)
    root = torch.tensor([100, 101, 102])
    result = accept(tree, anc, choice, root)
    for b in range(batch):
        path, bonus = walk_reference(
            tree.tokens[b].tolist(), tree.parents[b].tolist(), int(tree.num_nodes[b]), choice[b].tolist()
        )
        n = len(path) - 1
        assert int(result.accepted[b]) == n
        assert result.path[b, : n + 1].tolist() == path
        assert (result.path[b, n + 1 :] == path[-1]).all()
        assert int(result.bonus[b]) == bonus
        assert result.path_tokens[b, 0] == root[b]
        assert result.path_tokens[b, 1 : n + 1].tolist() == [int(tree.tokens[b, j]) for j in path[1:]]


def test_accept_stops_at_the_first_mismatch() -> None:
    logits = torch.full((1, 3, 5), -10.0)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 3] = 10.0
    tree = build_tree(logits, budget=3, topk=1)  # chain 1 -> 2 -> 3
    anc = ancestor_mask(tree)
    choice = torch.tensor([[1, 2, 4, 0]])  # root picks 1 (match), node1 picks 2 (match), node2 picks 4 (miss)
    result = accept(tree, anc, choice, torch.tensor([7]))
    assert result.accepted.tolist() == [2]
    assert result.bonus.tolist() == [4]
    assert result.path_tokens[0, :3].tolist() == [7, 1, 2]


def _ranks_reference(parents: list[int], path: list[int]) -> list[int]:
    """Each accepted node's rank: how many of its siblings come before it in the tree."""
    return [sum(1 for j in range(1, node) if parents[j] == parents[node]) for node in path[1:]]


@pytest.mark.parametrize("seed", range(12))
def test_accepted_ranks_match_the_siblings_before_each_accepted_node(seed: int) -> None:
    """On random trees, with a target that follows a random node's path (so that branches get accepted)."""
    gen = torch.Generator().manual_seed(seed)
    batch, depth, vocab, budget = 4, 5, 5, [3, 8, 16, 40][seed % 4]
    tree = build_tree(torch.randn(batch, depth, vocab, generator=gen) * 2, budget)
    choice = torch.randint(0, vocab, (batch, tree.width), generator=gen)
    for b in range(batch):
        node = int(torch.randint(1, int(tree.num_nodes[b]) + 1, (1,), generator=gen))
        while node > 0:  # the target picks each node's token at its parent, up to the root
            parent = int(tree.parents[b, node])
            choice[b, parent] = tree.tokens[b, node]
            node = parent
    result = accept(tree, ancestor_mask(tree), choice, torch.zeros(batch, dtype=torch.long))
    ranks = accepted_ranks(tree, result.path, depth)  # [batch, depth]
    assert ranks.shape == (batch, min(depth, tree.width - 1))
    offered = 0
    for b in range(batch):
        n = int(result.accepted[b])
        path = result.path[b, : n + 1].tolist()
        expect = _ranks_reference(tree.parents[b].tolist(), path)
        assert ranks[b, :n].tolist() == expect
        offered += sum(r > 0 for r in expect)
    if budget >= 16:
        assert offered, "some accepted node is off the chain"


def test_a_chain_has_rank_zero_everywhere_and_a_root_alone_has_no_ranks() -> None:
    gen = torch.Generator().manual_seed(0)
    chain = build_tree(torch.randn(2, 4, 6, generator=gen), 4, topk=1)  # dflash's tree
    choice = torch.where(chain.tokens < 0, 0, chain.tokens).roll(-1, dims=1)  # the target agrees everywhere
    result = accept(chain, ancestor_mask(chain), choice, torch.zeros(2, dtype=torch.long))
    assert result.accepted.tolist() == [4, 4]
    assert accepted_ranks(chain, result.path, 4).tolist() == [[0] * 4] * 2
    assert accepted_ranks(chain, result.path, 0).shape == (2, 0)
