from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree.cli import main


def test_bench_rows(tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    out = tmp_path / "rows.json"
    argv = ["bench", "--model", str(target), "--drafter", str(drafter), "--budgets", "2,16", "--limit", "3"]
    assert main([*argv, "--max-new-tokens", "8", "--batch-size", "2", "--json", str(out), "--baseline", "hf"]) == 0
    rows = json.loads(out.read_text())
    assert [(r["method"], r["budget"]) for r in rows] == [
        ("hf", None),
        ("ar", None),
        ("dflash", None),
        ("ddtree", 2),
        ("ddtree", 16),
    ]
    assert rows[0]["tau"] is None and rows[1]["tau"] == 1.0
    assert rows[0]["token_ids"] == rows[1]["token_ids"], "our ar equals HF generate, token for token"
    assert all(r["token_ids"] == rows[0]["token_ids"] for r in rows), "every method emits the same tokens"
    assert [len(t) for t in rows[0]["token_ids"]] == [8, 8, 8] and rows[0]["new_tokens"] == 24
    table = capsys.readouterr().out
    assert "vs ar" in table and "vs hf" in table and "hf generate" in table


def test_bench_telemetry_overhead(tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    argv = ["bench", "--model", str(target), "--drafter", str(drafter), "--methods", "ddtree", "--budgets", "4"]
    assert main([*argv, "--limit", "2", "--max-new-tokens", "4", "--telemetry-overhead", "--rounds", "1"]) == 0
    assert "on/off" in capsys.readouterr().out


def test_bench_rejects_unknown_methods(tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    assert main(["bench", "--model", str(target), "--drafter", str(drafter), "--methods", "beam"]) == 2
    assert "--methods" in capsys.readouterr().err


def test_overhead_schedule_alternates() -> None:
    """Every batch runs off and on back to back, and goes first both ways over the rounds."""
    from ddtree.bench import overhead_schedule

    runs = overhead_schedule(3, 2)
    assert len(runs) == 2 * 2 * 3
    pairs = [runs[i : i + 2] for i in range(0, len(runs), 2)]
    assert all({a[1], b[1]} == {False, True} and a[0] == b[0] for a, b in pairs), "off and on back to back"
    assert {(a[0], a[1]) for a, _ in pairs} == {(b, on) for b in range(3) for on in (False, True)}


def test_telemetry_overhead_observes_only_the_on_side(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """Only the on engine observes, and it observes every batch it runs (the off warm-up pass is not seen)."""
    from ddtree.bench import PairSpec, telemetry_overhead
    from ddtree.engine.decode import GenerationConfig
    from telemetry.config import TelemetryConfig

    target, drafter = tiny_dirs
    log = tmp_path / "steps.jsonl"
    config = TelemetryConfig(enabled=True, traces_exporter="none", metrics_exporter="none", log_file=str(log))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    generation = GenerationConfig(budget=4, max_new_tokens=6)
    off, on = telemetry_overhead(PairSpec(str(target), str(drafter), "cpu"), prompts, generation, 2, 2, config)
    assert off > 0 and on > 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    requests = [line for line in lines if line["event"] == "ddtree.request"]
    # The warm-up batch (2 prompts), then batches of 2 and 1 prompts in each of 2 rounds: 8 requests, once each.
    assert len(requests) == 2 + 2 * 3
    assert all(r["output_tokens"] == 6 for r in requests)


def test_bench_tree_build_times_the_torch_path_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--tree-build", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "32"), ("1", "256"), ("32", "32"), ("32", "256")]
    assert all(float(r[2]) > 0 and r[3] == "-" for r in rows), "torch timed; no fused path without a GPU"


def test_bench_writes_a_cost_curve_that_advise_reads(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    from telemetry.advise import read_cost

    target, drafter = tiny_dirs
    cost = tmp_path / "cost.json"
    argv = ["bench", "--model", str(target), "--drafter", str(drafter), "--methods", "ar,ddtree", "--budgets", "2,16"]
    assert main([*argv, "--limit", "2", "--max-new-tokens", "4", "--cost-curve", str(cost)]) == 0
    curve = read_cost(cost)
    assert [b for b, _ in curve.points] == [2, 16] and all(ms > 0 for _, ms in curve.points)
    assert json.loads(cost.read_text())["batch_size"] == 1
