from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.tree import DraftTree, Transition, build_tree, reachable_depth


def heap_reference(log_probs: np.ndarray, budget: int, topk: int) -> list[tuple[tuple[int, ...], float]]:
    """The paper's best-first search: pop the most probable prefix, push its children. float32 sums."""
    depth = log_probs.shape[0]
    order = np.argsort(-log_probs, axis=-1, kind="stable")[:, :topk]
    heap: list[tuple[float, tuple[int, ...]]] = []
    for tok in order[0]:
        heapq.heappush(heap, (-float(log_probs[0, tok]), (int(tok),)))
    out: list[tuple[tuple[int, ...], float]] = []
    while heap and len(out) < budget:
        neg, prefix = heapq.heappop(heap)
        out.append((prefix, -neg))
        d = len(prefix)
        if d < depth:
            for tok in order[d]:
                child = float(np.float32(-neg) + np.float32(log_probs[d, tok]))
                heapq.heappush(heap, (-child, (*prefix, int(tok))))
    return out


def tree_prefixes(tree: DraftTree, b: int) -> list[tuple[tuple[int, ...], float]]:
    tokens, parents = tree.tokens[b].tolist(), tree.parents[b].tolist()
    out = []
    for i in range(1, int(tree.num_nodes[b]) + 1):
        prefix, j = [], i
        while j > 0:
            prefix.append(tokens[j])
            j = parents[j]
        out.append((tuple(reversed(prefix)), float(tree.log_probs[b, i])))
    return out


def check_structure(tree: DraftTree, log_probs: torch.Tensor, topk: int) -> None:
    batch = tree.tokens.shape[0]
    for b in range(batch):
        n = int(tree.num_nodes[b])
        assert tree.parents[b, 0] == -1 and tree.tokens[b, 0] == -1 and tree.depths[b, 0] == 0
        kth = log_probs[b].topk(topk, dim=-1).values[:, -1]
        children: dict[int, set[int]] = {}
        for i in range(1, n + 1):
            p, d, tok = int(tree.parents[b, i]), int(tree.depths[b, i]), int(tree.tokens[b, i])
            assert 0 <= p < i, "a parent precedes its child"
            assert d == int(tree.depths[b, p]) + 1
            assert tok not in children.setdefault(p, set()), "siblings carry distinct tokens"
            children[p].add(tok)
            assert float(log_probs[b, d - 1, tok]) >= float(kth[d - 1]) - 1e-6, "only top-k tokens are candidates"
            expected = float(tree.log_probs[b, p]) + float(log_probs[b, d - 1, tok])
            assert float(tree.log_probs[b, i]) == pytest.approx(expected, abs=1e-4)
        assert (tree.tokens[b, n + 1 :] == -1).all() and (tree.parents[b, n + 1 :] == -1).all()
        assert torch.isinf(tree.log_probs[b, n + 1 :]).all()


# Random logits: a seed, a scale (0: all equal) and rounding (many exact ties).
LOGITS = {
    "seed": st.integers(0, 2**31 - 1),
    "scale": st.sampled_from([0.0, 0.5, 3.0, 30.0]),
    "rounded": st.booleans(),
}


def random_logits(shape: tuple[int, int, int], seed: int, scale: float, rounded: bool) -> torch.Tensor:
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale  # [batch, depth, vocab]
    return logits.round() if rounded else logits


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 3),
    depth=st.integers(1, 5),
    vocab=st.integers(1, 7),
    budget=st.integers(1, 70),
    topk_frac=st.floats(0.0, 1.0),
    **LOGITS,
)
def test_build_tree_matches_heap_reference(
    batch: int, depth: int, vocab: int, budget: int, topk_frac: float, seed: int, scale: float, rounded: bool
) -> None:
    logits = random_logits((batch, depth, vocab), seed, scale, rounded)
    topk = max(1, min(vocab, budget, round(topk_frac * vocab)))
    tree = build_tree(logits, budget, topk)
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    check_structure(tree, log_probs, topk)
    possible = sum(topk**d for d in range(1, depth + 1))
    for b in range(batch):
        ref = heap_reference(log_probs[b].numpy(), budget, topk)
        got = tree_prefixes(tree, b)
        assert len(got) == len(ref) == min(budget, possible)
        np.testing.assert_allclose(sorted(v for _, v in got), sorted(v for _, v in ref), atol=1e-4)


@pytest.mark.parametrize("seed", range(20))
def test_build_tree_selects_the_same_prefixes_as_the_heap(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, depth, vocab = 2, 6, 50
    logits = torch.randn(batch, depth, vocab, generator=gen) * 2
    budget = [1, 7, 32, 64][seed % 4]
    topk = [None, 3, 8, 50][seed % 4 - 1 if seed % 4 else 0]
    tree = build_tree(logits, budget, topk)
    log_probs = torch.log_softmax(logits, dim=-1)
    k = topk or min(budget, vocab)
    for b in range(batch):
        assert {p for p, _ in tree_prefixes(tree, b)} == {p for p, _ in heap_reference(log_probs[b].numpy(), budget, k)}


def test_nodes_come_in_order_of_probability() -> None:
    logits = torch.randn(4, 8, 100, generator=torch.Generator().manual_seed(1))
    tree = build_tree(logits, 64, 10)
    lp = tree.log_probs[:, 1:]
    assert (lp[:, :-1] >= lp[:, 1:]).all()


def test_topk_one_gives_the_greedy_chain() -> None:
    logits = torch.randn(3, 5, 20, generator=torch.Generator().manual_seed(2))
    tree = build_tree(logits, budget=5, topk=1)
    assert tree.num_nodes.tolist() == [5, 5, 5]
    assert torch.equal(tree.tokens[:, 1:], logits.argmax(-1))
    assert torch.equal(tree.parents[:, 1:], torch.arange(5).expand(3, -1))


@settings(max_examples=150, deadline=None)
@given(
    batch=st.integers(1, 3),
    depth=st.integers(2, 8),
    vocab=st.integers(1, 6),
    budget_frac=st.floats(0.0, 1.0),
    topk_frac=st.floats(0.0, 1.0),
    **LOGITS,
)
def test_depths_past_the_budget_never_change_the_tree(
    batch: int, depth: int, vocab: int, budget_frac: float, topk_frac: float, seed: int, scale: float, rounded: bool
) -> None:
    """The engine drafts only `reachable_depth(budget, depth)` positions: the tree must be the same without the
    deeper ones, ties (equal and zero log-probs) included."""
    budget = 1 + round(budget_frac * (depth - 2))  # 1 .. depth - 1
    logits = random_logits((batch, depth, vocab), seed, scale, rounded)
    topk = max(1, min(vocab, budget, round(topk_frac * vocab)))
    reach = reachable_depth(budget, depth)
    assert reach == budget < depth
    full, cut = build_tree(logits, budget, topk), build_tree(logits[:, :reach], budget, topk)
    assert int(full.depths.max()) <= reach
    for field in ("tokens", "parents", "depths", "log_probs", "num_nodes"):
        assert torch.equal(getattr(full, field), getattr(cut, field)), field


def conditioned_reference(
    log_probs: np.ndarray, parent: np.ndarray, child: np.ndarray, budget: int, topk: int
) -> list[tuple[tuple[int, ...], float]]:
    """Best-first search over the conditioned distribution, in float64: a depth's top-k candidates (by their
    marginals) re-weighted by `parent[t] . child[c]` under the parent's token t, keeping their marginal mass."""
    depth = log_probs.shape[0]
    order = np.argsort(-log_probs, axis=-1, kind="stable")[:, :topk]

    def step(d: int, prefix: tuple[int, ...]) -> list[tuple[int, float]]:
        ids = order[d]
        lp = log_probs[d, ids].astype(np.float64)
        if d == 0:
            return [(int(t), float(v)) for t, v in zip(ids, lp, strict=True)]
        score = lp + child[ids] @ parent[prefix[-1]]
        mass = np.log(np.exp(lp).sum())
        cond = score - np.log(np.exp(score).sum()) + mass
        return [(int(t), float(v)) for t, v in zip(ids, cond, strict=True)]

    heap = [(-v, (t,)) for t, v in step(0, ())]
    heapq.heapify(heap)
    out: list[tuple[tuple[int, ...], float]] = []
    while heap and len(out) < budget:
        neg, prefix = heapq.heappop(heap)
        out.append((prefix, -neg))
        if len(prefix) < depth:
            for tok, v in step(len(prefix), prefix):
                heapq.heappush(heap, (neg - v, (*prefix, tok)))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_a_conditioned_tree_is_the_most_probable_prefixes_of_the_conditioned_distribution(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, depth, vocab, rank = 2, 5, 12, 3
    logits = torch.randn(batch, depth, vocab, generator=gen) * 2
    transition = Transition(torch.randn(vocab, rank, generator=gen), torch.randn(vocab, rank, generator=gen))
    budget, topk = [(1, 4), (7, 3), (20, 6), (40, 12)][seed % 4]
    tree = build_tree(logits, budget, topk, transition)
    log_probs = torch.log_softmax(logits, dim=-1)
    marginal = build_tree(logits, budget, topk)
    for b in range(batch):
        ref = conditioned_reference(
            log_probs[b].numpy(), transition.parent.numpy(), transition.child.numpy(), budget, topk
        )
        got = tree_prefixes(tree, b)
        assert {p for p, _ in got} == {p for p, _ in ref}
        np.testing.assert_allclose(sorted(v for _, v in got), sorted(v for _, v in ref), atol=1e-4)
        values = [v for _, v in got]
        assert values == sorted(values, reverse=True), "nodes come in order of conditioned probability"
    if budget > 1:
        assert not torch.equal(tree.tokens, marginal.tokens), "the correction should change some tree"


def test_a_zero_transition_builds_the_marginal_tree() -> None:
    logits = torch.randn(3, 6, 40, generator=torch.Generator().manual_seed(0)) * 2
    zero = Transition(torch.zeros(40, 4), torch.randn(40, 4))
    for budget, topk in ((16, None), (32, 4)):
        plain, conditioned = build_tree(logits, budget, topk), build_tree(logits, budget, topk, zero)
        assert torch.equal(plain.tokens, conditioned.tokens) and torch.equal(plain.parents, conditioned.parents)
        torch.testing.assert_close(plain.log_probs, conditioned.log_probs)
