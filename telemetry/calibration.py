"""What the drafter predicts a tree will get accepted, and how well that holds.

A DDTree tree is the set of the B most probable prefixes, nodes 1..B in order of decreasing probability, and
its expected number of accepted drafts is the sum of its nodes' prefix probabilities (DDTree's Proposition 1,
exact where the drafter is calibrated). A tree of any width W <= B is its first W nodes, so one cumulative sum
over the tree the step built gives the expected accepted drafts at every width it could have run:

    E[accepted](W) = sum_{i=1..W} exp(log_prob[i])

`ddtree analyze` sets these predictions against the accepted drafts the target gave and fits a monotone map
from predicted to observed (`isotonic`): the calibration that a per-step choice of width reads. Free of torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def expected_accepted(log_probs: npt.NDArray[np.floating], widths: Sequence[int]) -> npt.NDArray[np.float64]:
    """`log_probs` [rows, 1 + budget] (node 0 the root, padding -inf), the tree's prefix log-probabilities in
    the tree's order -> [rows, len(widths)]: the expected accepted drafts of each row's first W nodes, per W."""
    probs = np.exp(np.asarray(log_probs, dtype=np.float64)[:, 1:])  # [rows, budget]; padding -> 0
    cumulative = np.cumsum(probs, axis=1)
    columns = [min(w, cumulative.shape[1]) - 1 for w in widths]
    return cumulative[:, columns] if columns else np.zeros((len(cumulative), 0))


def isotonic(
    x: Sequence[float], y: Sequence[float], weight: Sequence[float] | None = None
) -> tuple[list[float], list[float]]:
    """The non-decreasing fit of y against x by weighted least squares (pool adjacent violators), as knots
    (xs, ys) to interpolate between (`apply_map`); flat beyond the ends."""
    order = np.argsort(np.asarray(x, dtype=np.float64), kind="stable")
    xs = np.asarray(x, dtype=np.float64)[order]
    ys = np.asarray(y, dtype=np.float64)[order]
    ws = np.ones_like(xs) if weight is None else np.asarray(weight, dtype=np.float64)[order]
    blocks: list[list[float]] = []  # [mean y, weight, first x, last x]
    for xi, yi, wi in zip(xs, ys, ws, strict=True):
        blocks.append([yi, wi, xi, xi])
        while len(blocks) > 1 and blocks[-2][0] >= blocks[-1][0]:
            (y2, w2, a, _), (y1, w1, _, b) = blocks.pop(-2), blocks.pop()
            blocks.append([(y2 * w2 + y1 * w1) / (w2 + w1), w2 + w1, a, b])
    knots_x, knots_y = [], []
    for mean, _, first, last in blocks:
        knots_x += [float(first)] if first == last else [float(first), float(last)]
        knots_y += [float(mean)] * (1 if first == last else 2)
    return knots_x, knots_y


def apply_map(knots: tuple[Sequence[float], Sequence[float]], x: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """The calibrated value of each x: linear between the knots of `isotonic`, flat beyond them."""
    xs, ys = knots
    mapped: npt.NDArray[np.float64] = np.interp(np.asarray(x, dtype=np.float64), np.asarray(xs), np.asarray(ys))
    return mapped
