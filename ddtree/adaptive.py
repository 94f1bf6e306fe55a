"""Adaptive verification: each step verifies the width its own tree predicts pays most.

A DDTree tree's nodes 1..B come in order of decreasing prefix probability, so the tree of any width W <= B is
its first W nodes, and its expected accepted drafts are the sum of those nodes' prefix probabilities
(DDTree's Proposition 1, exact where the drafter is calibrated):

    E_i(W) = sum_{j=1..W} exp(log_prob_i[j])          row i of the step, W = 0 an `ar` step (no drafts)

Over the rows still decoding, a step of width W is predicted to make sum_i (1 + E_i(W)) tokens in cost(W)
seconds (the session's measured step time at its row count). The step runs the width with the most predicted
tokens per second. The choice only picks which of the tree's prefixes the target verifies; the accept walk
follows the target's own tokens whatever the width, so the output is unchanged (lossless at any width).

Pure tensor functions with no host sync: the choice is made on the device, and the session reads back one
small tensor to pick the width's captured graph.
"""

from __future__ import annotations

import torch

from ddtree.methods import curve_widths

ADAPTIVE = "adaptive"  # the budget that lets each step choose its width (`--budget adaptive`, `budget="adaptive"`)
DEFAULT_MAX_BUDGET = 64  # the widest tree an adaptive step may verify, unless told


def adaptive_widths(budget: int) -> tuple[int, ...]:
    """The widths an adaptive session of at most `budget` draft nodes chooses between: 0 (`ar`), the powers of
    two below `budget`, and `budget`."""
    return (0, *curve_widths(budget))


def expected_accepted(log_probs: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """`log_probs` [n, 1 + B] (node 0 the root, padding -inf) and `widths` [K] int64 (each <= B) -> [n, K]
    float32: each row's expected accepted drafts at each width (0 at width 0)."""
    probs = log_probs[:, 1:].float().exp()  # [n, B]; padding -> 0
    cumulative = torch.cat([torch.zeros_like(probs[:, :1]), probs.cumsum(dim=1)], dim=1)  # [n, 1 + B]
    return cumulative[:, widths]  # [n, K]


def calibrate(expected: torch.Tensor, knots_x: torch.Tensor, knots_y: torch.Tensor) -> torch.Tensor:
    """`expected` [n, K] through each width's monotone map, knots [K, M] ascending in x (as
    `telemetry.calibration.isotonic` fits them, padded by repeating the last knot): linear between the
    knots, flat beyond them -> [n, K]."""
    x = expected.transpose(0, 1).contiguous()  # [K, n]
    right = torch.searchsorted(knots_x, x).clamp(1, knots_x.shape[1] - 1)  # [K, n]
    x0, x1 = knots_x.gather(1, right - 1), knots_x.gather(1, right)
    y0, y1 = knots_y.gather(1, right - 1), knots_y.gather(1, right)
    t = ((x - x0) / (x1 - x0).clamp_min(1e-12)).clamp(0, 1)
    return (y0 + t * (y1 - y0)).transpose(0, 1)  # [n, K]


def choose_width(expected: torch.Tensor, active: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """`expected` [n, K] accepted drafts per row and width (width 0, `ar`, first), `active` [n] bool (rows still
    decoding), `cost` [K] a step's time at each width for these rows -> [2] float32: the index of the width with
    the most predicted tokens per unit of time, and its predicted gain (tokens per time) over width 0's."""
    tokens = (active[:, None].float() * (1 + expected.float())).sum(dim=0)  # [K]
    rate = tokens / cost.float()  # [K]
    best = rate.argmax()
    gain = rate[best] / rate[0].clamp_min(1e-12)
    return torch.stack([best.float(), gain])  # [2]
