"""`telemetry.calibration`: the widths a prediction is given at, the expected accepted drafts of a tree's first W
nodes, and the isotonic (non-decreasing) calibration map."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddtree.methods import curve_widths
from telemetry.calibration import apply_map, expected_accepted, isotonic


def test_curve_widths_are_the_powers_of_two_below_the_budget_and_the_budget() -> None:
    assert curve_widths(16) == [1, 2, 4, 8, 16]
    assert curve_widths(12) == [1, 2, 4, 8, 12]
    assert curve_widths(1) == [1]
    assert curve_widths(0) == []


def test_expected_accepted_sums_the_first_w_nodes_probabilities_and_reads_padding_as_zero() -> None:
    ninf = -math.inf
    log_probs = np.array(
        [
            [0.0, math.log(0.9), math.log(0.5), math.log(0.2)],
            [0.0, math.log(0.3), ninf, ninf],  # a tree of one node, padded
        ]
    )
    got = expected_accepted(log_probs, [1, 2, 3, 8])  # 8 is past the budget: the whole tree
    assert got == pytest.approx(np.array([[0.9, 1.4, 1.6, 1.6], [0.3, 0.3, 0.3, 0.3]]))
    assert expected_accepted(log_probs, []).shape == (2, 0)


def test_isotonic_keeps_a_non_decreasing_input_and_pools_a_violating_pair_to_its_weighted_mean() -> None:
    xs, ys = [3.0, 1.0, 2.0, 4.0], [5.0, 1.0, 2.0, 7.0]  # non-decreasing in x once sorted
    assert isotonic(xs, ys) == ([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 5.0, 7.0])
    assert isotonic([1.0, 2.0], [3.0, 1.0], weight=[1.0, 3.0]) == ([1.0, 2.0], [1.5, 1.5])
    knots = isotonic([0.0, 1.0, 2.0, 3.0], [0.0, 4.0, 2.0, 5.0])
    assert apply_map(knots, [0.0, 1.0, 2.0, 3.0]) == pytest.approx([0.0, 3.0, 3.0, 5.0])


def _brute_force(ys: list[float], ws: list[float]) -> list[float]:
    """The least-squares non-decreasing fit by trying every split into consecutive blocks, each at its weighted
    mean (the optimum is one of these), keeping the feasible one of least loss."""
    best: tuple[float, list[float]] = (math.inf, [])
    n = len(ys)
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), n]
        fit: list[float] = []
        for a, b in itertools.pairwise(bounds):
            mean = sum(y * w for y, w in zip(ys[a:b], ws[a:b], strict=True)) / sum(ws[a:b])
            fit += [mean] * (b - a)
        if all(u <= v + 1e-12 for u, v in itertools.pairwise(fit)):
            loss = sum(w * (f - y) ** 2 for f, y, w in zip(fit, ys, ws, strict=True))
            best = min(best, (loss, fit), key=lambda lf: lf[0])
    return best[1]


@given(
    st.lists(
        st.tuples(
            st.floats(-10, 10, allow_nan=False),
            # y and the weights on a grid of quarters: two fits whose losses differ by less than a rounding
            # error (a y of 1e-8 beside a 0) would leave the brute force's pick to the rounding
            st.integers(-40, 40).map(lambda q: q / 4),
            st.integers(1, 20).map(lambda q: q / 4),
        ),
        min_size=1,
        max_size=7,
        unique_by=lambda t: t[0],  # distinct x: a tie in x has no one value to map to
    )
)
def test_isotonic_matches_a_brute_force_fit(points: list[tuple[float, float, float]]) -> None:
    xs, ys, ws = (list(v) for v in zip(*points, strict=True))
    knots = isotonic(xs, ys, ws)
    assert all(u <= v for u, v in itertools.pairwise(knots[1])), "the fit is non-decreasing"
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    fitted = apply_map(knots, [xs[i] for i in order])
    expected = _brute_force([ys[i] for i in order], [ws[i] for i in order])
    assert fitted == pytest.approx(expected, abs=1e-9)


def test_apply_map_is_linear_between_the_knots_and_flat_beyond_them() -> None:
    knots = ([1.0, 2.0], [0.5, 1.5])
    assert apply_map(knots, [-10.0, 0.9, 1.5, 2.1, 100.0]) == pytest.approx([0.5, 0.5, 1.0, 1.5, 1.5])
