"""`ddtree analyze`'s calibration (the drafter's predicted accepted drafts against the target's), on hand-made
logs whose predictions are exactly twice what the target accepted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from matplotlib.figure import Figure

from ddtree.cli.main import main
from ddtree.methods import curve_widths
from telemetry import semconv as sc
from telemetry.analysis.calibration import (
    MAP_BINS,
    NO_PREDICTIONS,
    Observed,
    bins,
    calibration_map,
    calibration_table,
    plot_calibration,
)
from telemetry.analysis.digest import Digest
from telemetry.calibration import apply_map


def _line(method: str, budget: int, accepted: list[int], predicted: list[float] | None, warmup: bool = False) -> str:
    line: dict[str, Any] = {
        "event": sc.EVENT_STEP,
        sc.FIELD_STEP: 0,
        sc.FIELD_METHOD: method,
        sc.FIELD_BUDGET: budget,
        sc.FIELD_TOPK: None,
        sc.FIELD_WARMUP: warmup,
        sc.FIELD_ACCEPTED_DRAFTS: accepted,
        sc.FIELD_NODES_PER_DEPTH: [budget] if budget else [],
        sc.FIELD_ACCEPTED_PER_DEPTH: [1] if budget else [],
        sc.FIELD_EMITTED: [a + 1 for a in accepted],
        sc.FIELD_STAGE_MS: dict.fromkeys(sc.STAGES, 0.1),
    }
    if predicted is not None:
        widths = curve_widths(budget)
        line[sc.FIELD_PREDICTED_ACCEPTED] = predicted
        line[sc.FIELD_PREDICTED_WIDTHS] = widths
        line[sc.FIELD_PREDICTED_AT_WIDTHS] = [[p * w / budget for w in widths] for p in predicted]
    return json.dumps(line)


# ddtree B=16: two requests a step, accepted 0..7 three times each (mean 3.5), predicted exactly twice that (mean
# 7); the first step is a warm-up one, which counts (compiling changes no token). `ar`: no tree, no prediction.
ACCEPTED = [[a, (a + 3) % 8] for _ in range(3) for a in range(8)]
LOG = [
    *(_line("ddtree", 16, acc, [2.0 * a for a in acc], warmup=i == 0) for i, acc in enumerate(ACCEPTED)),
    _line("ar", 0, [0, 0], None),
]


def _observed(pairs: list[tuple[float, int]]) -> Observed:
    observed = Observed()
    observed.add([p for p, _ in pairs], [a for _, a in pairs])
    return observed


def test_predictions_twice_the_accepted_give_twice_the_mean_and_a_map_that_halves() -> None:
    configs = {c["label"]: c for c in Digest.of(LOG).summary()["configs"]}
    assert configs["ar"]["calibration"] is None, "no tree: no prediction"
    got = configs["ddtree B=16"]["calibration"]
    assert got["request_steps"] == 2 * len(ACCEPTED), "warm-up steps count"
    assert got["mean_accepted"] == pytest.approx(3.5)
    assert got["mean_predicted"] == pytest.approx(2 * got["mean_accepted"])
    assert got["mean_abs_error"] == pytest.approx(3.5)
    assert [b["count"] for b in got["bins"]] == [6] * 8  # eight distinct values, one bin each
    for b in got["bins"]:
        assert b["predicted"] == pytest.approx(2 * b["accepted"]) and b["low"] == b["high"] == b["predicted"]
    knots = (got["map"]["predicted"], got["map"]["accepted"])
    assert len(knots[0]) <= 2 * MAP_BINS
    probes = [0.0, 1.0, 3.0, 7.5, 13.0, 14.0]
    assert apply_map(knots, probes) == pytest.approx([p / 2 for p in probes])


def test_bins_cut_at_quantiles_merge_equal_values_and_the_map_never_falls() -> None:
    spread = _observed([(float(p), p % 3) for p in range(100)])  # accepted unrelated to the prediction
    cut = bins(spread)
    assert [b.count for b in cut] == [13, 12] * 4  # bin k ends at the first value with k/8 of them at or below
    assert [b.low for b in cut] == [0, 13, 25, 38, 50, 63, 75, 88] and cut[-1].high == 99
    knots = calibration_map(spread)
    assert len(knots[0]) <= 2 * MAP_BINS and knots[1] == sorted(knots[1])
    same = _observed([(2.0, 1), (2.0, 3), (2.0, 2)])  # one value: one bin, one knot
    assert [(b.count, b.predicted, b.accepted) for b in bins(same)] == [(3, 2.0, 2.0)]
    assert calibration_map(same) == ([2.0], [2.0])


def test_analyze_prints_the_table_and_says_when_a_log_has_no_predictions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "run.jsonl"
    log.write_text("\n".join(LOG) + "\n")
    assert main(["analyze", str(log)]) == 0
    out = capsys.readouterr().out
    rows = out[out.index("calibration:") :].splitlines()
    assert rows[1] == (
        "ddtree B=16: 48 request-steps with a prediction; predicted 7.000 (tau 8.000) against accepted 3.500 (tau"
        " 4.500); mean absolute error 3.500"
    )
    assert rows[3].split() == ["[0.000,", "0.000]", "6", "0.000", "0.000"]
    assert rows[10].split() == ["[14.000,", "14.000]", "6", "14.000", "7.000"]
    old = tmp_path / "old.jsonl"
    old.write_text(LOG[-1] + "\n")  # `ar` alone, as an older log without predictions reads
    assert main(["analyze", str(old)]) == 0
    assert NO_PREDICTIONS in capsys.readouterr().out
    assert calibration_table([("ddtree B=16", Observed())]) == [NO_PREDICTIONS]


def test_the_report_writes_the_entry_and_the_plot(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    log.write_text("\n".join(LOG) + "\n")
    assert main(["analyze", str(log), "--out", str(tmp_path / "out")]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    entry = {c["label"]: c["calibration"] for c in summary["configs"]}
    assert entry["ar"] is None
    assert set(entry["ddtree B=16"]) == {
        "request_steps",
        "mean_predicted",
        "mean_accepted",
        "mean_abs_error",
        "bins",
        "map",
    }
    assert entry["ddtree B=16"]["mean_predicted"] == pytest.approx(7.0)
    assert (tmp_path / "out" / "calibration.png").stat().st_size > 0


def test_the_plot_draws_the_bins_the_map_and_the_diagonal_or_says_there_are_no_predictions() -> None:
    digest = Digest.of(LOG)
    items = [(g.label, g.calibration) for g in digest.sorted_configs()]
    ax = Figure().add_subplot()
    plot_calibration(ax, items)
    dots, fitted, diagonal = ax.get_lines()
    assert [line.get_label() for line in (dots, fitted, diagonal)] == [
        "ddtree B=16 (bins)",
        "ddtree B=16 map",
        "calibrated (y = x)",
    ]
    assert list(dots.get_xdata()) == pytest.approx([1 + 2 * a for a in range(8)])  # acceptance lengths
    assert list(dots.get_ydata()) == pytest.approx([1 + a for a in range(8)])
    assert [1 + (x - 1) / 2 for x in fitted.get_xdata()] == pytest.approx(list(fitted.get_ydata()))
    empty = Figure().add_subplot()
    plot_calibration(empty, [("ar", Observed())])
    assert [line.get_label() for line in empty.get_lines()] == ["calibrated (y = x)"]
    assert empty.texts[0].get_text() == "no predictions in the log"
