"""`ddtree bench --temperature --seed --budget-schedule`: what reaches the rows, the header, `--out` and the
cost curve, and the one-line errors (exit 2) for values it cannot run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddtree.cli.main import main
from ddtree.schedule import BudgetSchedule, Choice, write_schedule


def _argv(tiny_dirs: tuple[Path, Path], *extra: str) -> list[str]:
    target, drafter = tiny_dirs
    pair = ["--model", str(target), "--drafter", str(drafter), "--device", "cpu"]
    return ["bench", *pair, "--num-prompts", "3", "--max-new-tokens", "6", "--budgets", "2,8", *extra]


def _rows(tiny_dirs: tuple[Path, Path], out: Path, *extra: str) -> list[dict[str, Any]]:
    assert main([*_argv(tiny_dirs, *extra), "--out", str(out)]) == 0
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    return rows


def _decoded(rows: list[dict[str, Any]]) -> list[tuple[object, ...]]:
    return [(r["method"], r["budget"], r["tau"], r["token_ids"]) for r in rows]


def test_temperature_and_seed_reach_every_row(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "rows.json"
    first = _rows(tiny_dirs, out, "--temperature", "0.8", "--seed", "5")
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith(", temperature 0.8, seed 5")
    again = _rows(tiny_dirs, out, "--temperature", "0.8", "--seed", "5")
    other = _rows(tiny_dirs, out, "--temperature", "0.8", "--seed", "6")
    greedy = _rows(tiny_dirs, out)
    assert _decoded(first) == _decoded(again)
    assert all(a["token_ids"] != b["token_ids"] for a, b in zip(first, other, strict=True)), "the seed counts"
    assert all(a["token_ids"] != g["token_ids"] for a, g in zip(first, greedy, strict=True)), "sampled"
    assert {(r["temperature"], r["seed"]) for r in first} == {(0.8, 5)}
    assert {(r["temperature"], r["seed"]) for r in greedy} == {(0.0, 0)}


def test_temperature_zero_is_the_greedy_bench(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An explicit 0 (any seed) is the default run: every row emits HF generate's greedy tokens."""
    out = tmp_path / "rows.json"
    default = _rows(tiny_dirs, out, "--baseline", "hf")
    assert "temperature 0 (greedy), seed 0" in capsys.readouterr().out.splitlines()[0]
    explicit = _rows(tiny_dirs, out, "--baseline", "hf", "--temperature", "0", "--seed", "7")
    assert _decoded(default) == _decoded(explicit)
    assert default[0]["method"] == "hf" and all(r["token_ids"] == default[0]["token_ids"] for r in default)


def test_the_cost_curve_holds_the_temperature_and_each_budgets_tau(
    tiny_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    from telemetry.analysis.cost import read_costs

    cost, out, plan = tmp_path / "cost.json", tmp_path / "rows.json", tmp_path / "schedule.json"
    write_schedule(plan, BudgetSchedule((Choice(1, "ddtree", 4),)))
    extra = [
        "--methods",
        "ar,ddtree",
        "--temperature",
        "0.7",
        "--cost-curve",
        str(cost),
        "--budget-schedule",
        str(plan),
    ]
    rows = _rows(tiny_dirs, out, *extra)
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", None), ("ddtree", 2), ("ddtree", 8), ("auto", None)]
    costs = read_costs(cost)
    assert costs.temperature == 0.7
    assert costs.tau == {1: {r["budget"]: r["tau"] for r in rows if r["method"] == "ddtree"}}
    (curve,) = json.loads(cost.read_text())["curves"]
    assert [p["budget"] for p in curve["points"]] == [2, 8], "the auto row is no point of the curve"
    assert "tau" not in curve and curve["ar_step_ms"] > 0


def test_a_budget_schedule_adds_an_auto_row_even_without_ddtree(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan, out = tmp_path / "schedule.json", tmp_path / "rows.json"
    write_schedule(plan, BudgetSchedule((Choice(1, "ddtree", 8), Choice(4, "ar"))))
    rows = _rows(tiny_dirs, out, "--methods", "ar", "--budget-schedule", str(plan))
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", None), ("auto", None)]
    ar, auto = rows
    assert auto["tau"] is not None and auto["tau"] >= 1.0 and auto["steps"] > 0
    assert auto["token_ids"] == ar["token_ids"], "greedy and lossless"
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("auto ")]
    assert line.split()[1] == f"{auto['tau']:.2f}" and line.split()[-1].endswith("x"), "tau and the ratio to ar"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature=-1"], "--temperature must be >= 0, got -1.0"),
        (["--temperature", "nan"], "--temperature must be a finite number, got nan"),
        (["--temperature", "warm"], "--temperature must be a number, got 'warm'"),
        (["--seed=-1"], "--seed must be in 0..4294967295, got -1"),
        (["--seed", "1.5"], "--seed must be an integer, got '1.5'"),
        (["--temperature", "0.5", "--baseline", "hf"], "--baseline hf decodes greedily only"),
        (["--budget-schedule", "{missing}"], "--budget-schedule: cannot read the schedule"),
        (["--budget-schedule", "{garbage}"], "--budget-schedule: '{garbage}' is not a budget schedule"),
        (["--budget-schedule", "{wrong}"], "is not a budget schedule: format 'ddtree.cost/2'"),
        (["--budget-schedule", "{garbage}", "--telemetry-overhead"], "--telemetry-overhead runs no table"),
    ],
)
def test_bad_values_exit_2_with_one_line(
    extra: list[str], message: str, tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {"missing": tmp_path / "none.json", "garbage": tmp_path / "garbage.json", "wrong": tmp_path / "cost.json"}
    files["garbage"].write_text("{not json")
    files["wrong"].write_text(json.dumps({"format": "ddtree.cost/2", "curves": []}))
    names = {key: str(path) for key, path in files.items()}
    assert main(_argv(tiny_dirs, *(word.format(**names) for word in extra))) == 2
    out, err = capsys.readouterr()
    assert message.format(**names) in err and err.count("\n") == 1 and out == "", "refused before any row runs"
