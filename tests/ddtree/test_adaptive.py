"""The adaptive rule's tensor functions against plain numpy and brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree.adaptive import (
    adaptive_caps,
    adaptive_widths,
    best_cap,
    calibrated,
    calibration_scale,
    choose_width,
    commitment,
    decision,
    expected_accepted,
)
from telemetry import calibration


def test_the_widths_are_ar_the_powers_of_two_below_the_budget_and_the_budget() -> None:
    assert adaptive_widths(16) == (0, 1, 2, 4, 8, 16)
    assert adaptive_widths(12) == (0, 1, 2, 4, 8, 12)
    assert adaptive_widths(1) == (0, 1)


def _log_probs(rng: np.random.Generator, rows: int, budget: int) -> np.ndarray:
    """Decreasing prefix log-probabilities per row, node 0 the root (0), a random tail of padding (-inf)."""
    lp = np.sort(np.log(rng.uniform(0.01, 1.0, size=(rows, budget))), axis=1)[:, ::-1]
    for row, nodes in enumerate(rng.integers(1, budget + 1, size=rows)):
        lp[row, nodes:] = -np.inf
    return np.concatenate([np.zeros((rows, 1)), lp], axis=1)


@pytest.mark.parametrize("seed", range(3))
def test_expected_accepted_is_the_telemetry_prediction_and_zero_at_width_zero(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lp = _log_probs(rng, 5, 16)
    widths = list(adaptive_widths(16))
    got = expected_accepted(torch.tensor(lp, dtype=torch.float32), torch.tensor(widths)).numpy()
    want = calibration.expected_accepted(lp, widths[1:])
    assert np.allclose(got[:, 1:], want, atol=1e-5)
    assert (got[:, 0] == 0).all()


def test_calibration_scales_each_width_by_its_own_outcome_shrunk_to_the_pooled_one() -> None:
    accepted, predicted = [0.0, 30.0, 10.0, 0.0], [0.0, 20.0, 20.0, 0.0]  # width 3 never ran
    scale = calibration_scale(accepted, predicted, prior=0.0)
    assert scale[1] == pytest.approx(1.5) and scale[2] == pytest.approx(0.5)
    assert scale[0] == pytest.approx(1.0) and scale[3] == pytest.approx(1.0)  # the pooled 40 / 40
    shrunk = calibration_scale(accepted, predicted, prior=20.0)
    assert shrunk[1] == pytest.approx((30 + 20) / (20 + 20)) and 0.5 < shrunk[2] < 1.0
    assert calibration_scale([0.0], [0.0]) == [1.0]  # nothing seen yet: the raw prediction
    assert calibration_scale([100.0], [1.0]) == [4.0]  # a ratio far off is bounded


def test_the_calibrated_prediction_never_exceeds_the_width() -> None:
    expected = torch.tensor([[0.0, 0.9, 1.5, 2.0]])
    widths = torch.tensor([0, 1, 2, 4])
    got = calibrated(expected, torch.tensor([1.0, 2.0, 1.2, 0.5]), widths)
    assert got[0].tolist() == pytest.approx([0.0, 1.0, 1.8, 1.0])


def test_the_decision_carries_the_raw_prediction_at_the_chosen_width_over_active_rows() -> None:
    expected = torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.6, 0.9], [0.0, 5.0, 9.0]])  # the third row finished
    active = torch.tensor([True, True, False])
    widths = torch.tensor([0, 1, 2])
    index, gain, raw, rows, *rest = decision(expected, torch.ones(3), widths, active, torch.ones(3)).tolist()
    curve, gains = rest[:3], rest[3:]
    assert index == 2 and raw == pytest.approx(1.9) and gain == pytest.approx((2 + 1.9) / 2)
    assert rows == 2 and curve == pytest.approx([0.0, 1.1, 1.9])
    assert gains == pytest.approx([1.0, 3.1 / 2, 3.9 / 2])
    scaled = decision(expected, torch.tensor([1.0, 1.0, 0.1]), widths, active, torch.tensor([1.0, 1.0, 1.0]))
    assert scaled.tolist()[0] == 1 and scaled.tolist()[2] == pytest.approx(1.1)  # raw, not scaled


@pytest.mark.parametrize("seed", range(20))
def test_the_choice_is_the_width_with_most_predicted_tokens_per_second(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows, k = int(rng.integers(1, 6)), int(rng.integers(2, 7))
    expected = np.sort(rng.uniform(0, 5, size=(rows, k)), axis=1)
    expected[:, 0] = 0
    active = rng.uniform(size=rows) < 0.8
    active[0] = True
    cost = rng.uniform(0.5, 3.0, size=k)
    decision = choose_width(torch.tensor(expected), torch.tensor(active), torch.tensor(cost)).tolist()
    rate = [sum(1 + expected[i, w] for i in range(rows) if active[i]) / cost[w] for w in range(k)]
    assert int(decision[0]) == int(np.argmax(rate))
    assert decision[1] == pytest.approx(max(rate) / rate[0], rel=1e-5)
    assert decision[2:] == pytest.approx([r / rate[0] for r in rate], rel=1e-5)  # every width's gain


def test_the_caps_are_4_and_8_below_the_budget_and_the_budget() -> None:
    assert adaptive_caps(64) == (4, 8, 64)
    assert adaptive_caps(8) == (4, 8)
    assert adaptive_caps(3) == (3,)


def test_the_best_cap_is_the_one_whose_best_width_pays_most() -> None:
    expected = [0.0, 0.9, 1.6, 2.2, 2.6]  # widths 0, 1, 2, 4, 8 of the widest cap
    costs = {4: [1.0, 1.2, 1.3, 1.5], 8: [1.4, 1.6, 1.7, 1.9, 2.1]}  # the wider draft costs every width more
    assert best_cap(expected, costs) == 4  # 3.2 / 1.5 beats 3.6 / 2.1
    assert best_cap(expected, {4: costs[4], 8: [1.0, 1.0, 1.0, 1.0, 1.1]}) == 8
    unseen = [0.0, 0.9, None, None, None]  # only what was seen counts
    assert best_cap(unseen, costs) == 4
    assert best_cap(expected, {4: [1.0] * 4, 8: [1.0] * 4 + [3.6 / 3.2]}) == 4  # a tie: the narrower draft


def test_rows_that_no_longer_decode_weigh_nothing() -> None:
    expected = torch.tensor([[0.0, 0.1, 0.2], [0.0, 50.0, 90.0]])  # the second row finished
    cost = torch.tensor([1.0, 1.5, 2.0])
    index, gain, *_ = choose_width(expected, torch.tensor([True, False]), cost).tolist()
    assert (index, gain) == (0, 1.0)
    index, *_ = choose_width(expected, torch.tensor([True, True]), cost).tolist()
    assert index == 2


def test_a_window_commits_where_running_one_width_unread_makes_at_least_what_deciding_made() -> None:
    waited, unwaited = [1.0, 1.2, 1.5], [0.9, 1.0, 1.2]  # the wait costs every width some time
    same = [([1.0, 1.4, 1.6], 2.0)] * 4  # every step chose width 2
    assert commitment(same, waited, unwaited) == 2
    assert commitment(same, waited, waited) == 2  # even where the wait costs nothing: the same choices
    varied = [([1.0, 1.4, 1.1], 2.0), ([1.0, 1.1, 1.6], 2.0)] * 2  # width 1 and 2 in turn, each by far
    assert commitment(varied, waited, waited) is None  # deciding beats either width every step
    assert commitment(varied, waited, [0.5, 0.5, 0.6]) == 2  # unless the wait costs more than deciding gains
    assert commitment([], waited, unwaited) is None


@pytest.mark.parametrize("seed", range(10))
def test_the_commitment_is_checked_against_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k, steps = int(rng.integers(2, 6)), int(rng.integers(1, 20))
    waited = rng.uniform(1.0, 2.0, size=k)
    unwaited = waited * rng.uniform(0.7, 1.0, size=k)
    window = [(list(rng.uniform(0.5, 2.0, size=k) / 1.0), float(rng.integers(1, 5))) for _ in range(steps)]
    window = [([1.0, *g[1:]], a) for g, a in window]  # width 0's gain over itself
    tokens = np.array([[g[j] * waited[j] * a for j in range(k)] for g, a in window])
    chose = [int(np.argmax(g)) for g, _ in window]
    deciding = sum(tokens[t, c] for t, c in enumerate(chose)) / sum(waited[c] for c in chose)
    rates = tokens.sum(axis=0) / (steps * unwaited)
    got = commitment(window, list(waited), list(unwaited))
    assert got == (int(np.argmax(rates)) if rates.max() >= deciding else None)
