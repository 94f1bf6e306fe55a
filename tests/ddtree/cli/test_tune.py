"""`ddtree tune`: the three phases on a tiny pair write a schedule that `serve --budget auto` would find, and
bad values are one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree.cli.main import main
from ddtree.runtime import pair_identity, schedule_path
from ddtree.schedule import read_schedule
from telemetry.analysis.cost import read_costs


def _argv(tiny_dirs: tuple[Path, Path], *extra: str) -> list[str]:
    target, drafter = tiny_dirs
    pair = ["--model", str(target), "--drafter", str(drafter), "--device", "cpu"]
    return ["tune", *pair, "--num-prompts", "4", "--max-new-tokens", "6", "--budgets", "2,6", *extra]


def test_tune_writes_the_schedule_where_serve_looks(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DDTREE_HOME", str(tmp_path / "home"))
    keep = tmp_path / "kept"
    assert main(_argv(tiny_dirs, "--batch-sizes", "1,2", "--log-slots", "2", "--keep", str(keep))) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("ddtree tune: 4 prompts, 6 new tokens") and "min" in first
    assert "1/3" in out and "2/3" in out and "3/3" in out
    from ddtree.models.pair import load_models

    target, _, _ = load_models(str(tiny_dirs[0]), str(tiny_dirs[1]), "cpu", "auto")
    identity = pair_identity(str(tiny_dirs[0]), str(tiny_dirs[1]), target)
    schedule = read_schedule(schedule_path(identity))
    assert [c.batch_size for c in schedule.choices] == [1, 2]
    assert dict(schedule.tuned_for) == identity and schedule.mismatch(identity) is None
    assert all(c.method in ("ar", "ddtree") and c.predicted_tokens_per_second for c in schedule.choices)
    costs = read_costs(keep / "tune-costs.json")
    assert sorted(costs.curves) == [1, 2] and set(costs.tau[1]) == {2, 6} and costs.temperature == 0.0
    steps = [json.loads(line) for line in (keep / "tune-log.jsonl").read_text().splitlines() if '"ddtree.step"' in line]
    assert steps and {s["budget"] for s in steps} == {6}, "the logged run is at the largest budget"
    assert "replayed from ddtree B=6" in out, "at T=0 the plan replays the logged run"
    assert main(_argv(tiny_dirs, "--batch-sizes", "1,2", "--log-slots", "2", "--keep", str(keep))) == 0
    again = capsys.readouterr().out
    assert "1/3 the logged run: kept" in again and "(1,2 kept)" in again, "a second run resumes in --keep"
    assert read_schedule(schedule_path(identity)).choices == schedule.choices


def test_tune_out_and_sampled_plans_use_the_measured_tau(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "schedule.json"
    argv = _argv(tiny_dirs, "--batch-sizes", "2", "--log-slots", "2", "--temperature", "0.8", "--out", str(out))
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "estimates" in printed and "measured in the cost file" in printed
    assert [c.batch_size for c in read_schedule(out).choices] == [2]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--budgets", "0"], "--budgets"),
        (["--batch-sizes", "x"], "--batch-sizes"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--prompts", "/nonexistent/prompts.jsonl"], "prompts"),
    ],
)
def test_bad_tune_flags_exit_2_with_one_line(
    tiny_dirs: tuple[Path, Path], extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(tiny_dirs, *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ddtree: error: ") and message in err and len(err.splitlines()) == 1
