"""The drafter's predicted accepted drafts against the target's: `ddtree analyze`'s calibration table, its
summary.json entry and its plot.

A tree method's step line carries, per request, `predicted_accepted`: the expected accepted drafts of the tree
the step ran, from the drafter's probabilities (`telemetry.calibration`), beside `accepted_drafts`, what the
target accepted. Per configuration, `Observed` keeps those pairs (12 bytes a request-step); from them:
- the means per request-step (predicted, accepted; tau = 1 + either) and the mean absolute error;
- bins of the prediction at its quantiles (`TABLE_BINS`, merged where edges coincide: a value is never split
  across bins), each with its count and mean predicted and accepted: how reliable the prediction is;
- the calibration map, the non-decreasing fit of accepted on predicted (`telemetry.calibration.isotonic`). It is
  fitted on the means of `MAP_BINS` quantile bins weighted by their counts, not on every pair, so it has at most
  2 * `MAP_BINS` knots (a pooled run of bins is two) and its fit is one short pass whatever the log's length.

Warm-up steps count, as they do for tau and the chain counts (`telemetry.analysis.steps`): compiling a graph
changes no token and no probability, only the step's time. Logs written before step lines carried predictions,
and `ar` steps (no tree), have none: the table says so instead of showing zeros.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from telemetry.calibration import isotonic

if TYPE_CHECKING:
    from matplotlib.axes import Axes  # only the report draws: the table needs no matplotlib

TABLE_BINS = 8  # quantile bins of the table, summary.json and the plot
MAP_BINS = 16  # quantile bins the calibration map is fitted on: at most 32 knots

NO_PREDICTIONS = (
    "calibration: no predictions in this log (step lines written before they carried `predicted_accepted`, and"
    " `ar` steps, which run no tree, have none)"
)


@dataclass
class Observed:
    """One configuration's request-steps with a prediction: predicted and accepted drafts, in log order."""

    predicted: array[float] = field(default_factory=lambda: array("d"))
    accepted: array[int] = field(default_factory=lambda: array("i"))

    @property
    def request_steps(self) -> int:
        return len(self.predicted)

    def add(self, predicted: Sequence[float], accepted: Sequence[int]) -> None:
        """One step line's `predicted_accepted` and `accepted_drafts` (per request, in the same order)."""
        n = min(len(predicted), len(accepted))
        self.predicted.extend(float(p) for p in predicted[:n])
        self.accepted.extend(int(a) for a in accepted[:n])

    def arrays(self) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """(predicted, accepted) as float arrays [request_steps]."""
        return np.asarray(self.predicted, dtype=np.float64), np.asarray(self.accepted, dtype=np.float64)


@dataclass(frozen=True)
class Bin:
    """Request-steps whose prediction lies in [low, high] (the smallest and largest in the bin), with the
    mean predicted and the mean accepted drafts of them."""

    low: float
    high: float
    count: int
    predicted: float
    accepted: float


def bins(observed: Observed, n: int = TABLE_BINS) -> list[Bin]:
    """At most `n` bins of the prediction with edges at its quantiles, in increasing order; equal edges merge
    (so a bin never splits a value and none is empty). Empty without predictions."""
    if not observed.request_steps:
        return []
    predicted, accepted = observed.arrays()
    order = np.argsort(predicted, kind="stable")
    p, a = predicted[order], accepted[order]  # [request_steps], by prediction
    edges = np.quantile(p, np.linspace(0.0, 1.0, n + 1)[1:-1], method="inverted_cdf")  # the last value of bins
    starts = np.unique(np.concatenate([[0], np.searchsorted(p, edges, side="right")]))  # first index of each bin
    starts = starts[starts < len(p)]
    ends = np.append(starts[1:], len(p))
    p_sums, a_sums = np.add.reduceat(p, starts), np.add.reduceat(a, starts)
    return [
        Bin(float(p[s]), float(p[e - 1]), int(e - s), float(ps / (e - s)), float(as_ / (e - s)))
        for s, e, ps, as_ in zip(starts, ends, p_sums, a_sums, strict=True)
    ]


def calibration_map(observed: Observed) -> tuple[list[float], list[float]]:
    """The calibration map's knots (predicted, accepted), for `telemetry.calibration.apply_map`: the isotonic
    fit on the means of `MAP_BINS` quantile bins, weighted by their counts (see the module docstring)."""
    fit = bins(observed, MAP_BINS)
    return isotonic([b.predicted for b in fit], [b.accepted for b in fit], [b.count for b in fit])


def means(observed: Observed) -> tuple[float, float, float]:
    """(mean predicted, mean accepted, mean absolute error) per request-step; request-steps must be > 0."""
    predicted, accepted = observed.arrays()
    return float(predicted.mean()), float(accepted.mean()), float(np.abs(predicted - accepted).mean())


def shown(items: Sequence[tuple[str, Observed]]) -> list[tuple[str, Observed]]:
    """The configurations with predictions (`ar` and older logs have none)."""
    return [(label, o) for label, o in items if o.request_steps]


def calibration_table(items: Sequence[tuple[str, Observed]]) -> list[str]:
    """The table's lines, for (label, observed) per configuration; one line saying why where there is none."""
    rows = shown(items)
    if not rows:
        return [NO_PREDICTIONS]
    lines = [
        "calibration: accepted drafts per request-step, as the drafter predicted them and as the target gave them:"
    ]
    for label, o in rows:
        predicted, accepted, error = means(o)
        lines.append(
            f"{label}: {o.request_steps} request-steps with a prediction; predicted {predicted:.3f} (tau"
            f" {1 + predicted:.3f}) against accepted {accepted:.3f} (tau {1 + accepted:.3f}); mean absolute error"
            f" {error:.3f}"
        )
        lines.append(f"  {'predicted in':>21}{'steps':>9}{'predicted':>11}{'accepted':>10}")
        for b in bins(o):
            span = f"[{b.low:.3f}, {b.high:.3f}]"
            lines.append(f"  {span:>21}{b.count:>9}{b.predicted:>11.3f}{b.accepted:>10.3f}")
    return lines


def calibration_summary(observed: Observed) -> dict[str, Any] | None:
    """summary.json's entry for one configuration (in accepted drafts per request-step); None without
    predictions."""
    if not observed.request_steps:
        return None
    predicted, accepted, error = means(observed)
    knots_x, knots_y = calibration_map(observed)
    return {
        "request_steps": observed.request_steps,
        "mean_predicted": predicted,
        "mean_accepted": accepted,
        "mean_abs_error": error,
        "bins": [
            {"low": b.low, "high": b.high, "predicted": b.predicted, "accepted": b.accepted, "count": b.count}
            for b in bins(observed)
        ],
        "map": {"predicted": knots_x, "accepted": knots_y},
    }


def plot_calibration(ax: Axes, items: Sequence[tuple[str, Observed]]) -> None:
    """Reliability of the acceptance length: per configuration, the bins' mean predicted against mean accepted
    (1 + drafts, dots) and the calibration map (a line through its knots), against the diagonal y = x."""
    rows = shown(items)
    top = 2.0
    for label, o in rows:
        fit = bins(o)
        xs, ys = [1 + b.predicted for b in fit], [1 + b.accepted for b in fit]
        top = max(top, *xs, *ys)
        dots = ax.plot(xs, ys, ls="none", marker="o", label=f"{label} (bins)")
        knots_x, knots_y = calibration_map(o)
        ax.plot(
            [1 + x for x in knots_x],
            [1 + y for y in knots_y],
            color=dots[0].get_color(),
            marker="_" if len(knots_x) == 1 else None,  # one knot: a line of one point shows nothing
            label=f"{label} map",
        )
    ax.plot([1, top], [1, top], color="grey", ls=":", label="calibrated (y = x)")
    if not rows:
        ax.text(0.5, 0.5, "no predictions in the log", ha="center", transform=ax.transAxes)
    ax.set_xlabel("predicted acceptance length (1 + expected accepted drafts)")
    ax.set_ylabel("acceptance length (1 + accepted drafts)")
    ax.set_title("Calibration: predicted against accepted")
