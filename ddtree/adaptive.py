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

from collections.abc import Mapping, Sequence

import torch

from ddtree.methods import curve_widths

ADAPTIVE = "adaptive"  # the budget that lets each step choose its width (`--budget adaptive`, `budget="adaptive"`)
DEFAULT_MAX_BUDGET = 64  # the widest tree an adaptive step may verify, unless told
PRIOR_STEPS = 8.0  # predicted drafts' worth of weight that pulls a width's calibration toward the pooled one


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


def calibrated(expected: torch.Tensor, scale: torch.Tensor, widths: torch.Tensor) -> torch.Tensor:
    """`expected` [n, K] times each width's calibration `scale` [K] (what the target accepted over what the
    drafter predicted, at that width), capped at the width: no tree of W drafts accepts more than W -> [n, K]."""
    return torch.minimum(expected * scale[None, :], widths[None, :].to(expected.dtype))


def calibration_scale(accepted: Sequence[float], predicted: Sequence[float], prior: float = PRIOR_STEPS) -> list[float]:
    """Each width's scale from the request steps that ran it: its accepted drafts over its raw prediction, each
    summed over those steps, shrunk toward the scale of all widths together by `prior` steps' worth of weight
    (a width seldom run keeps the pooled scale), within [1/4, 4]."""
    pooled = min(4.0, max(0.25, sum(accepted) / sum(predicted))) if sum(predicted) > 0 else 1.0
    return [
        min(4.0, max(0.25, (a + prior * pooled) / (p + prior))) if p + prior > 0 else pooled
        for a, p in zip(accepted, predicted, strict=True)
    ]


def choose_width(expected: torch.Tensor, active: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    """`expected` [n, K] accepted drafts per row and width (width 0, `ar`, first), `active` [n] bool (rows still
    decoding), `cost` [K] a step's time at each width for these rows -> [2 + K] float32: the index of the width
    with the most predicted tokens per unit of time, its predicted gain (tokens per time) over width 0's, and
    every width's predicted gain over width 0's."""
    tokens = (active[:, None].float() * (1 + expected.float())).sum(dim=0)  # [K]
    rate = tokens / cost.float()  # [K]
    gains = rate / rate[0].clamp_min(1e-12)  # [K]
    gain, best = gains.max(dim=0)  # no indexing by a device scalar: that would read it back (and break capture)
    return torch.cat([torch.stack([best.float(), gain]), gains])  # [2 + K]


def adaptive_caps(budget: int) -> tuple[int, ...]:
    """The widest trees an adaptive session may draft at a row count: 4 and 8 where below `budget`, and
    `budget`. A narrower tree drafts fewer depths (`ddtree.tree.reachable_depth`), which is what most of the
    draft's cost depends on; at a row count where wide trees do not pay, drafting the widest one would cost
    every step the depths that no chosen width reaches."""
    return (*(c for c in (4, 8) if c < budget), budget)


def best_cap(expected: Sequence[float | None], costs: Mapping[int, Sequence[float]]) -> int:
    """The cap whose best width has the most predicted tokens per second for one row: `expected` per width of
    the widest cap's list (a row's calibrated accepted drafts on average; None: not seen yet), `costs[cap]`
    the step time of each width of that cap (a prefix of the list). Unseen widths are left out."""

    def rate(cap: int) -> float:
        seen = [(1 + e) / c for e, c in zip(expected, costs[cap], strict=False) if e is not None and c > 0]
        return max(seen, default=0.0)

    return max(costs, key=lambda cap: (rate(cap), -cap))


def decision(
    expected: torch.Tensor, scale: torch.Tensor, widths: torch.Tensor, active: torch.Tensor, cost: torch.Tensor
) -> torch.Tensor:
    """The step's choice from its raw predictions `expected` [n, K]: `choose_width` on the calibrated ones ->
    [4 + 2K] float32: the width's index, its predicted gain, the raw prediction at that width summed over the
    active rows (what the session's calibration sets against the drafts the target then accepts), the active
    rows, the raw prediction at each width summed over them (the row count's mean curve), and each width's
    predicted gain (for a step that runs a width it did not wait to choose)."""
    chosen = choose_width(calibrated(expected, scale, widths), active, cost)  # [2 + K]
    live = active.float()  # [n]
    column = chosen[0].long().view(1, 1).expand(expected.shape[0], 1)  # [n, 1], on the device
    raw = (live * expected.float().gather(1, column)[:, 0]).sum()
    curve = (live[:, None] * expected.float()).sum(dim=0)  # [K]
    return torch.cat([chosen[:2], raw[None], live.sum()[None], curve, chosen[2:]])  # [4 + 2K]


def commitment(
    window: Sequence[tuple[Sequence[float], float]], waited: Sequence[float], unwaited: Sequence[float]
) -> int | None:
    """Whether deciding each step paid over the window's steps, on the host: each step's predicted gain at
    every width (over width 0's) and its active rows, with a step's time at each width when the host waits for
    the decision (`waited`, what the gains were computed with) and when it does not (`unwaited`). A step's
    predicted tokens at width k are gain[k] x waited[k] x active (over width 0's time, a common factor). Deciding
    makes the chosen widths' tokens over their waited times; running width k unread every step makes its
    tokens over its unwaited time. Returns the index of the width whose tokens per second, run unread, are at
    least deciding's (the best such), or None: the wait pays."""
    if not window:
        return None
    tokens = [[g * w * active for g, w in zip(gains, waited, strict=True)] for gains, active in window]  # [T][K]
    chosen = [max(range(len(gains)), key=gains.__getitem__) for gains, _ in window]
    deciding = sum(t[c] for t, c in zip(tokens, chosen, strict=True)) / sum(waited[c] for c in chosen)
    rates = [sum(t[k] for t in tokens) / (len(window) * unwaited[k]) for k in range(len(waited))]
    best = max(range(len(rates)), key=rates.__getitem__)
    return best if rates[best] >= deciding * (1 - 1e-9) else None
