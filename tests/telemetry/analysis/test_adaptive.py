"""The adaptive rule replayed on a log: the width each step's prediction and the cost curve choose."""

from __future__ import annotations

from typing import Any

import pytest

from telemetry import semconv as sc
from telemetry.analysis.adaptive import AR, AdaptiveLog, AdaptiveReplay
from telemetry.analysis.cost import CostFile, cost_curve
from telemetry.calibration import apply_map

COST = CostFile({4: cost_curve([(1, 1.0), (2, 1.5)], "test")}, {4: 0.8})  # ms per step at 4 rows


def test_each_step_runs_the_width_its_prediction_says_pays_most() -> None:
    replay = AdaptiveReplay()
    # Step 1: sure drafts. W=2 predicts (2 + 3.6) / 1.5 = 3.73 a ms, W=1 (2 + 1.8) / 1 = 3.8, ar 2 / 0.8 = 2.5.
    replay.add(4, [1, 2], [[0.9, 1.8], [0.9, 1.8]], [[1, 2], [1, 2]])
    # Step 2: unsure drafts: ar pays most (2 / 0.8 = 2.5 against (2 + 0.2) / 1 = 2.2).
    replay.add(4, [1, 2], [[0.1, 0.15], [0.1, 0.15]], [[], [1]])
    result = replay.evaluate(COST)
    assert result["chosen_widths"] == {str(AR): 1, "1": 1}
    # replayed: step 1 accepts 1 draft a row at W=1 (4 tokens, 1 ms); step 2 runs ar (2 tokens, 0.8 ms)
    assert result["adaptive_tokens_per_second"] == pytest.approx(6 / 1.8e-3)
    fixed = result["fixed_tokens_per_second"]
    assert fixed["1"] == pytest.approx((4 + 3) / 2e-3)  # step 2 accepts node 1 on the second row
    assert fixed["2"] == pytest.approx((6 + 3) / 3e-3)
    assert fixed[str(AR)] == pytest.approx(4 / 1.6e-3)
    best = max(fixed.values())
    assert result["adaptive_over_best_fixed"] == pytest.approx(result["adaptive_tokens_per_second"] / best)


def test_calibrated_the_rule_reads_what_each_width_was_seen_to_give() -> None:
    curve = cost_curve([(1, 1.0), (2, 1.2)], "test")
    cost = CostFile({1: curve}, {})
    replay = AdaptiveReplay()
    for _ in range(4):  # the drafter promises 1.8 drafts at W=2; the second node is never accepted
        replay.add(1, [1, 2], [[0.9, 1.8]], [[1]])
    maps = replay.maps()
    assert [float(apply_map(m, [p])[0]) for m, p in zip(maps, [0.9, 1.8], strict=True)] == [1.0, 1.0]
    raw = replay.evaluate(cost)  # (1 + 1.8) / 1.2 = 2.33 a ms at W=2 against 1.9 at W=1
    assert raw["chosen_widths"] == {"2": 4}
    calibrated = replay.evaluate(cost, calibrated=True)  # (1 + 1) / 1.2 = 1.67 against 2.0: W=1
    assert calibrated["chosen_widths"] == {"1": 4}
    assert calibrated["adaptive_tokens_per_second"] == pytest.approx(2 / 1e-3)
    assert raw["adaptive_tokens_per_second"] == pytest.approx(2 / 1.2e-3)


def _step(step: int, ids: list[str], curves: list[list[float]], warmup: bool = False) -> dict[str, Any]:
    return {
        "event": sc.EVENT_STEP,
        sc.FIELD_STEP: step,
        sc.FIELD_METHOD: "ddtree",
        sc.FIELD_BUDGET: 2,
        sc.FIELD_TOPK: None,
        sc.FIELD_ROWS: 4,
        sc.FIELD_WARMUP: warmup,
        sc.FIELD_REQUEST_IDS: ids,
        sc.FIELD_PREDICTED_WIDTHS: [1, 2],
        sc.FIELD_PREDICTED_AT_WIDTHS: curves,
    }


def _request(rid: str, steps: list[int], paths: list[list[int]]) -> dict[str, Any]:
    return {
        "event": sc.EVENT_REQUEST,
        sc.FIELD_REQUEST_ID: rid,
        sc.FIELD_METHOD: "ddtree",
        sc.FIELD_BUDGET: 2,
        sc.FIELD_TOPK: None,
        sc.FIELD_PATH_STEPS: steps,
        sc.FIELD_ACCEPTED_PATHS: paths,
    }


def test_a_step_replays_once_every_request_in_it_has_ended() -> None:
    log = AdaptiveLog()
    for record in (
        _step(0, ["a", "b"], [[0.5, 1.0], [0.2, 0.3]], warmup=True),  # warm-up: not replayed
        _step(1, ["a", "b"], [[0.5, 1.0], [0.2, 0.3]]),
        _step(2, ["b"], [[0.9, 1.2]]),
        _step(3, ["b", "c"], [[0.9, 1.2], [0.1, 0.1]]),
        _request("b", [1, 2, 3], [[1], [1, 2], []]),
    ):
        log(record)
    key = ("ddtree", 2, None)
    assert len(log.replays[key].steps) == 1  # step 2, all of whose requests have ended
    log(_request("a", [1], [[1, 2]]))
    log(_request("c", [], []))  # its line has no path for step 3: that step cannot be replayed
    steps = log.replays[key].steps
    assert [rows for rows, _, _ in steps] == [4, 4]
    assert sorted(paths for _, _, paths in steps) == [[[1, 2]], [[1, 2], [1]]]
    assert log.left_out == 1 and not log.pending


def test_at_fewer_rows_a_step_stands_for_its_requests_in_groups() -> None:
    curve = cost_curve([(1, 1.0), (2, 1.2)], "test")
    cost = CostFile({1: curve, 4: curve}, {1: 0.8, 4: 0.8})
    replay = AdaptiveReplay()
    replay.add(4, [1, 2], [[0.99, 1.98], [0.05, 0.06]], [[1, 2], []])  # one sure request, one unsure
    together = replay.evaluate(cost)  # one step of both: (2 + 2.04) / 1.2 = 3.37 a ms at W=2, 3.04 at W=1
    assert together["steps"] == 1 and together["chosen_widths"] == {"2": 1}
    alone = replay.evaluate(cost, rows=1)  # each on its own: W=2 for the sure one (2.48), ar for the other (1.25)
    assert alone["steps"] == 2 and alone["chosen_widths"] == {"0": 1, "2": 1}
    assert alone["adaptive_tokens_per_second"] == pytest.approx((3 + 1) / 2.0e-3)
