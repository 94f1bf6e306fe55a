from __future__ import annotations

import pickle

import pytest
import torch

from ddtree.observer import GenerateInfo
from ddtree.tree import build_tree
from telemetry.stats import StepStats
from tests.telemetry.test_reconcile import walked_depth

INFO = GenerateInfo("ddtree", 10, 2, 0.0, 8, 0, ["a", "b", "c"], [[1], [2], [3]])


def _stats(depths: torch.Tensor | None, accepted: list[int]) -> StepStats:
    n = len(accepted)
    rows = None if depths is None else depths.numpy()
    return StepStats(0, INFO, [True] * n, rows, accepted, [a + 1 for a in accepted], {}, 0, 1)


@pytest.mark.parametrize("seed", range(5))
def test_counts_from_depths_match_a_walk_over_the_tree(seed: int) -> None:
    torch.manual_seed(seed)
    # vocab 3, top-2, depth 3: at most 2 + 4 + 8 = 14 prefixes, so budget 10 fills some trees and pads others
    logits = torch.randn(3, 3, 3) * torch.tensor([0.1, 3.0, 10.0])[:, None, None]
    tree = build_tree(logits, budget=10, topk=2)
    accepted = [0, 2, 3]
    stats = _stats(tree.depths, accepted)

    # Independent of the depth field and of `num_nodes`: a node is a slot with a parent, its depth is the
    # number of hops up to the root.
    per_depth = [0] * tree.width
    nodes = []
    for row in tree.parents.tolist():
        drafts = [slot for slot, parent in enumerate(row) if parent >= 0]
        nodes.append(len(drafts))
        for slot in drafts:
            per_depth[walked_depth(row, slot)] += 1
    assert stats.tree_nodes == nodes
    assert stats.nodes_per_depth == per_depth
    assert stats.accepted_per_depth == [0, 2, 2, 1] + [0] * (tree.width - 4)
    assert stats.tree_depth == max(d for d, n in enumerate(per_depth) if n)


def test_a_step_without_a_tree_counts_nothing() -> None:
    stats = _stats(None, [0, 0])
    assert stats.tree_nodes == [0, 0]
    assert stats.nodes_per_depth == [0]
    assert stats.accepted_per_depth == [0]
    assert stats.tree_depth == 0


def test_the_fields_sent_to_the_exporter_rebuild_the_same_counts() -> None:
    tree = build_tree(torch.randn(3, 4, 5), budget=6)
    stats = _stats(tree.depths, [1, 0, 4])
    sent = pickle.loads(pickle.dumps((stats.active, stats.depths, stats.accepted, stats.emitted)))
    rebuilt = StepStats(0, INFO, *sent, {}, 0, 1)
    assert rebuilt.nodes_per_depth == stats.nodes_per_depth
    assert rebuilt.tree_nodes == stats.tree_nodes == [6, 6, 6]


def test_a_step_without_its_trees_depths_still_has_per_depth_counts_of_one_length() -> None:
    """A loop that skipped `on_tree` for a step (no depths): no depth counts, and nothing raises for the sinks."""
    stats = _stats(None, [0, 2, 3])
    assert stats.nodes_per_depth == [0] and stats.accepted_per_depth == [0] and stats.tree_depth == 0
    assert stats.tree_nodes == [0, 0, 0] and stats.accepted == [0, 2, 3]


def test_the_prediction_is_the_sum_of_the_first_nodes_prefix_probabilities() -> None:
    torch.manual_seed(0)
    tree = build_tree(torch.randn(2, 4, 6) * 2, budget=12, topk=3)
    stats = StepStats(
        0, INFO, [True, True], tree.depths.numpy(), [1, 2], [2, 3], {}, 0, 1, log_probs=tree.log_probs.numpy()
    )
    assert stats.predicted_widths == [1, 2, 4, 8, 12]
    assert stats.predicted is not None
    for row, curve in zip(tree.log_probs, stats.predicted, strict=True):
        probs = row[1:].exp()  # node 0 is the root; nodes 1.. in the tree's order, best first
        assert curve == pytest.approx([float(probs[:w].sum()) for w in stats.predicted_widths], rel=1e-6)
        assert curve[0] == pytest.approx(float(probs.max()))  # the one best node first
    assert _stats(tree.depths, [1, 2]).predicted is None  # no log-probabilities: no prediction
