from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ddtree.cli.main import main
from ddtree.train.data import TrainingSequence, pack_sequences
from ddtree.train.runs import EVAL_LABELS, describe_data, loss_curve, tau_points
from ddtree.train.trainer import TrainConfig, train

ROOT = Path(__file__).resolve().parents[3]
Fresh = Callable[[], tuple[torch.nn.Module, Any]]


def test_loss_curve_averages_consecutive_steps_into_at_most_50_points() -> None:
    history = [{"step": s, "loss": float(s)} for s in range(1, 121)]
    curve = loss_curve(history)
    assert len(curve) == 50 and curve[-1][0] == 120
    assert curve[0] == [3, 2.0]  # steps 1..3 (120 steps in 50 runs: 20 of 3, then 30 of 2)
    assert curve[20] == [62, 61.5]
    assert [p[0] for p in curve] == sorted({p[0] for p in curve})
    short = [{"step": s, "loss": 1.0 / s} for s in range(7, 11)]
    assert loss_curve(short) == [[s, round(1.0 / s, 4)] for s in range(7, 11)]
    assert loss_curve([]) == []


def test_each_run_appends_its_record(tmp_path: Path, tiny_data: list[TrainingSequence], fresh: Fresh) -> None:
    cfg = TrainConfig(steps=10, batch_size=4, anchors=4, warmup=2, checkpoint_every=3)
    model, drafter = fresh()
    first = train(drafter, model, tiny_data, tmp_path, cfg, quiet=True, stop_at=4)
    model, drafter = fresh()
    train(drafter, model, tiny_data, tmp_path, cfg, resume=True, quiet=True)
    model, drafter = fresh()
    train(drafter, model, tiny_data, tmp_path, cfg, resume=True, quiet=True)  # nothing left to do: no record
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert [(r["run"], r["start_step"], r["end_step"], r["stopped"]) for r in runs] == [
        (1, 0, 4, "stop_at"),
        (2, 4, 10, "steps"),
    ]
    assert [p[0] for p in runs[0]["loss_curve"]] == [1, 2, 3, 4]
    assert [p[0] for p in runs[1]["loss_curve"]] == list(range(5, 11))
    assert runs[0]["final_loss"] == first["final_loss"]
    assert runs[1]["data"] == describe_data(tiny_data)
    assert runs[1]["data"]["tokens"] == sum(len(s.ids) for s in tiny_data) > runs[1]["data"]["response_tokens"]
    assert runs[1]["config"]["steps"] == 10 and runs[1]["cumulative_seconds"] >= runs[0]["cumulative_seconds"]


def test_eval_heldout_stores_the_teacher_forced_tau_in_the_run_record(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`drafter train --eval-heldout` on packed data, on the CLI's tiny pair: tau of dflash and ddtree B=32
    on the 64 held-out prompts, teacher-forced, equal to what `ddtree bench` decodes for the same drafter and
    settings."""
    target, _ = tiny_dirs
    rng = random.Random(0)
    seqs = [TrainingSequence([rng.randrange(256) for _ in range(24)], 4) for _ in range(16)]
    pack_sequences(seqs, tmp_path / "data")
    out = tmp_path / "drafter"
    argv = ["drafter", "train", "--target", str(target), "--data", str(tmp_path / "data"), "--out", str(out)]
    argv += ["--steps", "3", "--batch-size", "4", "--anchors", "4", "--num-layers", "1", "--block-size", "5"]
    assert main([*argv, "--device", "cpu", "--eval-heldout", "--distill", "kl", "--gamma", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    record = json.loads((out / "runs.json").read_text())[-1]
    assert record["eval"] == report["eval"] and record["config"]["gamma"] == 3.0
    assert record["eval"]["measure"] == "teacher-forced" and record["eval"]["prompts"] == 64
    tau = record["eval"]["tau"]
    assert sorted(tau) == sorted(EVAL_LABELS) and all(1.0 <= t <= 5.0 for t in tau.values())
    bench = ["bench", "--model", str(target), "--drafter", str(out), "--methods", "dflash,ddtree", "--budgets", "32"]
    bench += ["--limit", "64", "--max-new-tokens", "64", "--batch-size", "16", "--device", "cpu"]
    assert main([*bench, "--json", str(tmp_path / "bench.json")]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [round(r["tau"], 4) for r in rows] == [tau["dflash"], tau["ddtree B=32"]]


def _tiny_training(target: Path, tmp_path: Path, seed: int, steps: int) -> list[str]:
    """`drafter train` arguments, less `--out`, for a 1-layer drafter of the tiny target on 8 random sequences
    of 20 tokens, packed into tmp_path/data."""
    rng = random.Random(seed)
    seqs = [TrainingSequence([rng.randrange(256) for _ in range(20)], 4) for _ in range(8)]
    pack_sequences(seqs, tmp_path / "data")
    argv = ["drafter", "train", "--model", str(target), "--data", str(tmp_path / "data"), "--device", "cpu"]
    argv += ["--steps", str(steps), "--batch-size", "2", "--anchors", "2", "--num-layers", "1", "--block-size", "4"]
    return argv


def test_eval_every_records_the_curve_within_the_run(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "drafter"
    argv = _tiny_training(tiny_dirs[0], tmp_path, seed=1, steps=4)
    assert main([*argv, "--out", str(out), "--eval-every", "1e-9"]) == 0
    capsys.readouterr()
    evals = json.loads((out / "runs.json").read_text())[-1]["evals"]
    assert [e["step"] for e in evals] == [1, 2, 3, 4], "every step is past the interval, and the end evaluates"
    assert all(set(e["tau"]) == set(EVAL_LABELS) for e in evals)


def test_a_run_from_init_continues_the_history_of_its_weights(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--init DIR` brings DIR's run records along, and the new run's times continue theirs."""
    argv = _tiny_training(tiny_dirs[0], tmp_path, seed=2, steps=2)
    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*argv, "--out", str(first)]) == 0
    history = json.loads((first / "runs.json").read_text())
    history[0]["cumulative_seconds"] = 1000.0  # as if the weights had trained for 1,000 s
    (first / "runs.json").write_text(json.dumps(history))
    assert main([*argv, "--out", str(second), "--init", str(first), "--eval-every", "1e-9"]) == 0
    runs = json.loads((second / "runs.json").read_text())
    assert runs[0] == history[0] and runs[1]["run"] == 2
    assert runs[1]["cumulative_seconds"] == round(1000.0 + runs[1]["wall_seconds"], 1)
    assert all(1000.0 <= e["seconds"] <= runs[1]["cumulative_seconds"] for e in runs[1]["evals"])
    assert main([*argv, "--out", str(second), "--init", str(first)]) == 0  # records of its own: kept, not replaced
    capsys.readouterr()
    runs = json.loads((second / "runs.json").read_text())
    assert [r["run"] for r in runs] == [1, 2, 3]
    assert runs[2]["cumulative_seconds"] == round(runs[1]["cumulative_seconds"] + runs[2]["wall_seconds"], 1)


def test_bad_training_options_are_clear_errors(
    tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    target, _ = tiny_dirs
    base = ["drafter", "train", "--target", str(target), "--data", "x", "--out", "y"]
    assert main([*base, "--total-minutes", "0"]) == 2
    assert "--total-minutes must be > 0, got 0.0" in capsys.readouterr().err
    assert main([*base, "--gamma", "-1"]) == 2
    assert "--gamma must be > 0, got -1.0" in capsys.readouterr().err


def _runs(taus: list[tuple[float, float] | None]) -> list[dict[str, Any]]:
    runs = []
    for i, pair in enumerate(taus):
        record: dict[str, Any] = {"run": i + 1, "cumulative_seconds": 300.0 * (i + 1)}
        if pair is not None:
            record["eval"] = {"tau": dict(zip(EVAL_LABELS, pair, strict=True))}
        runs.append(record)
    return runs


def test_tau_points_follow_cumulative_time_and_skip_runs_without_eval() -> None:
    points = tau_points(_runs([(1.5, 1.9), None, (1.7, 2.2)]))
    assert points == {"dflash": [(5.0, 1.5), (15.0, 1.7)], "ddtree B=32": [(5.0, 1.9), (15.0, 2.2)]}


def test_tau_points_can_keep_the_teacher_forced_measure_only() -> None:
    runs = _runs([(1.5, 1.9), (1.7, 2.2), (1.8, 2.3)])
    runs[1]["eval"]["measure"] = "teacher-forced"
    runs[2]["evals"] = [{"seconds": 1200.0, "tau": {"dflash": 1.75}}]  # within a run: teacher-forced
    assert tau_points(runs)["dflash"] == [(5.0, 1.5), (10.0, 1.7), (20.0, 1.75)]
    assert tau_points(runs, teacher_forced_only=True)["dflash"] == [(10.0, 1.7), (20.0, 1.75)]


def test_the_plot_script_writes_a_png(tmp_path: Path) -> None:
    for name, taus in (("ce", [(1.5, 1.9), (1.7, 2.2)]), ("kl", [(1.6, 2.0), None, (1.8, 2.4)])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "runs.json").write_text(json.dumps(_runs(taus)))
    png = tmp_path / "runs.png"
    script = ROOT / "scripts" / "plot_drafter_runs.py"
    args = [sys.executable, str(script), str(tmp_path / "ce" / "runs.json"), str(tmp_path / "kl" / "runs.json")]
    done = subprocess.run([*args, "--out", str(png)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    (tmp_path / "none.json").write_text(json.dumps(_runs([None])))
    done = subprocess.run([*args[:2], str(tmp_path / "none.json"), "--out", str(png)], capture_output=True, text=True)
    assert done.returncode == 2 and "no run has a held-out evaluation" in done.stderr


def test_drafter_init_reads_the_feature_layers_asked_for(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, _ = tiny_dirs  # 2 layers
    base = ["drafter", "init", "--model", str(target), "--block-size", "4"]
    assert main([*base, "--out", str(tmp_path / "d"), "--feature-layers", "1,0"]) == 0
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 0]
    for wrong in ("0,2", "1,1"):
        assert main([*base, "--out", str(tmp_path / "e"), "--feature-layers", wrong]) == 2
        err = capsys.readouterr().err.strip()
        assert f"--feature-layers must be distinct layers of the target's 0..1, got {wrong}" in err
        assert len(err.splitlines()) == 1
