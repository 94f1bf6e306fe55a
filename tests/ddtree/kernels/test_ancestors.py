"""The ancestor matrix of one Triton kernel against `ddtree.tree.ancestor_mask`.

On CPU the kernel runs in Triton's interpreter; with DDTREE_TEST_DEVICE=cuda the same tests run on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")

from ddtree.kernels.ancestors import ancestor_mask_fused
from ddtree.tree import DraftTree, ancestor_mask, build_tree

DEVICE = torch.device(os.environ.get("DDTREE_TEST_DEVICE", "cpu"))


@pytest.mark.parametrize(
    ("batch", "depth", "vocab", "budget", "topk"),
    [(1, 1, 4, 1, None), (3, 5, 4, 16, None), (2, 15, 50, 64, None), (2, 6, 3, 200, None), (4, 15, 9, 150, 2)],
)
def test_equals_the_torch_ancestor_mask(batch: int, depth: int, vocab: int, budget: int, topk: int | None) -> None:
    """Deep chains, wide and bushy trees, more rows than one program holds (200 + 1 nodes), and trees with
    fewer real nodes than the budget (their unused slots have parent -1 and see only themselves)."""
    gen = torch.Generator().manual_seed(budget + depth)
    tree = build_tree((torch.randn((batch, depth, vocab), generator=gen) * 3).to(DEVICE), budget, topk)
    assert torch.equal(ancestor_mask_fused(tree), ancestor_mask(tree))


def test_a_hand_made_tree_in_any_node_order() -> None:
    """Node 3's parent comes after it: the walk follows parents wherever they are."""
    parents = torch.tensor([[-1, 0, 3, 1, -1]], device=DEVICE)  # 0 <- 1 <- 3 <- 2; node 4 unused
    zeros = torch.zeros_like(parents)
    tree = DraftTree(tokens=zeros, parents=parents, depths=zeros, log_probs=zeros.float(), num_nodes=zeros[:, 0])
    expect = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 1, 0], [0, 0, 0, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(ancestor_mask_fused(tree).cpu()[0], expect)
    assert torch.equal(ancestor_mask(tree).cpu()[0], expect)
