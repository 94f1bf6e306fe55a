"""The readback's columns (`ddtree.engine.probe`): built on the device, taken apart on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree.accept import AcceptResult, accepted_ranks
from ddtree.engine.probe import ProbeLayout, readout, split_rows
from ddtree.tree import build_tree


def _result(rows: int, path: int) -> AcceptResult:
    """An accept result whose columns are easy to tell apart: accepted 1.., path tokens 10.., bonus 90.."""
    tokens = torch.arange(path).repeat(rows, 1) + 10 * (torch.arange(rows)[:, None] + 1)  # [rows, path]
    return AcceptResult(
        path=torch.zeros((rows, path), dtype=torch.long),
        accepted=torch.arange(1, rows + 1),
        bonus=torch.arange(90, 90 + rows),
        path_tokens=tokens,
    )


def test_a_hand_made_row_splits_into_tokens_and_probe() -> None:
    """Row layout: accepted, path tokens (2), bonus | depths, tokens, parents, log_probs (2 nodes) | 3 stamps."""
    layout = ProbeLayout(start=4, nodes=2, stamps=3)
    minus_half = int(np.array([-0.5], dtype=np.float32).view(np.int32)[0])
    blocks = ([1, 7, 8, 9], [0, 1], [-1, 5], [-1, 0], [0, minus_half], [100, 250, 400])
    row = [value for block in blocks for value in block]
    block = np.array([row, row], dtype=np.int64)  # [2 rows, 15]
    tokens, probe = split_rows(block, layout)
    assert layout.width == 15
    assert tokens == [[1, 7, 8, 9], [1, 7, 8, 9]]
    assert probe.depths.tolist() == [[0, 1]] * 2 and probe.tokens.tolist() == [[-1, 5]] * 2
    assert probe.parents.tolist() == [[-1, 0]] * 2 and probe.log_probs.tolist() == [[0.0, -0.5]] * 2
    assert probe.stamps_ns == [100, 250, 400]
    assert split_rows(block[:, :-3], ProbeLayout(4, 2, 0))[1].stamps_ns is None, "no stamps: None"
    with pytest.raises(ValueError, match="15 columns for a layout of 12"):
        split_rows(block, ProbeLayout(4, 2, 0))


@pytest.mark.parametrize("stamped", [False, True])
def test_the_device_row_comes_back_as_the_tree(stamped: bool) -> None:
    """`readout` then `split_rows` gives back the token rows and the tree exactly (-inf log-probs included)."""
    gen = torch.Generator().manual_seed(0)
    tree = build_tree(torch.randn((3, 2, 2), generator=gen) * 3, 9, None)  # 3 rows, 10 slots: 6 prefixes, padding
    result = _result(3, 5)
    stamps = torch.tensor([5, 8, 13, 21, 34]) if stamped else None  # [stages + 1]
    out, layout = readout(result, tree, stamps)
    assert layout is not None and out.shape == (3, layout.width) and out.dtype == torch.int64
    tokens, probe = split_rows(out.numpy().copy(), layout)
    plain, no_layout = readout(result, None, None)
    assert no_layout is None and tokens == plain.tolist(), "the token part is the unobserved readback"
    assert tokens[1] == [2, *range(20, 25), 91]
    assert np.array_equal(probe.depths, tree.depths.numpy())
    assert np.array_equal(probe.tokens, tree.tokens.numpy())
    assert np.array_equal(probe.parents, tree.parents.numpy())
    assert probe.log_probs.dtype == np.float32 and np.array_equal(probe.log_probs, tree.log_probs.numpy())
    assert np.isneginf(probe.log_probs).any(), "the tree has padding"
    assert layout.ranks == 4 and np.array_equal(probe.ranks, accepted_ranks(tree, result.path, 9).numpy())
    assert probe.stamps_ns == ([5, 8, 13, 21, 34] if stamped else None), "the stamps come after the ranks"


def test_the_ranks_sit_between_the_tree_and_the_stamps() -> None:
    """A hand-made row with 2 rank columns: the probe cuts them out, and the stamps after them."""
    row = [0, 7, 9, *[0, 1, 1], *[-1, 5, 6], *[-1, 0, 0], *[0, 0, 0], *[1, 1], *[100, 250]]
    tokens, probe = split_rows(np.array([row], dtype=np.int64), ProbeLayout(start=3, nodes=3, stamps=2, ranks=2))
    assert tokens == [[0, 7, 9]] and probe.ranks.tolist() == [[1, 1]] and probe.stamps_ns == [100, 250]
