from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddtree.cli import main


def test_bench_rows(tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    out = tmp_path / "rows.json"
    argv = ["bench", "--model", str(target), "--drafter", str(drafter), "--budgets", "2,16", "--limit", "3"]
    assert main([*argv, "--max-new-tokens", "8", "--batch-size", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["method"], r["budget"]) for r in rows] == [("ar", None), ("dflash", None), ("ddtree", 2), ("ddtree", 16)]
    assert rows[0]["tau"] == 1.0
    assert len({r["new_tokens"] for r in rows}) == 1, "every method emits the same tokens"
    assert "vs ar" in capsys.readouterr().out


def test_bench_telemetry_overhead(tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    argv = ["bench", "--model", str(target), "--drafter", str(drafter), "--methods", "ddtree", "--budgets", "4"]
    assert main([*argv, "--limit", "2", "--max-new-tokens", "4", "--telemetry-overhead", "--rounds", "1"]) == 0
    assert "on/off" in capsys.readouterr().out


def test_bench_rejects_unknown_methods(tiny_dirs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_dirs
    assert main(["bench", "--model", str(target), "--drafter", str(drafter), "--methods", "beam"]) == 2
    assert "--methods" in capsys.readouterr().err


def test_telemetry_overhead_warms_both_engines_and_alternates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold first run is slow on a GPU: both engines are warmed, and every batch runs off and on in
    alternating order, so neither side always goes first."""
    from ddtree import bench
    from ddtree.engine.decode import GenerationConfig, GenerationResult, RequestOutput
    from telemetry.config import TelemetryConfig
    from telemetry.hooks import NOOP

    calls: list[tuple[bool, int]] = []

    def fake_generate(self: bench.Engine, prompts: list[list[int]], config: GenerationConfig) -> GenerationResult:
        calls.append((self.observer is not NOOP, prompts[0][0]))
        return GenerationResult(outputs=[RequestOutput(token_ids=[1, 2])], steps=1, seconds=0.01)

    monkeypatch.setattr(bench.Engine, "generate", fake_generate)
    target = type("T", (), {"device": torch.device("cpu")})()
    config = TelemetryConfig(enabled=True, traces_exporter="none", metrics_exporter="none", log_file="/dev/null")
    prompts = [[0], [1], [2]]
    bench.telemetry_overhead(target, None, prompts, GenerationConfig(), 1, 2, config)  # type: ignore[arg-type]
    assert sorted(calls[:2]) == [(False, 0), (True, 0)], "both engines warmed up on the first batch"
    runs = calls[2:]
    assert len(runs) == 2 * 2 * len(prompts)
    pairs = [runs[i : i + 2] for i in range(0, len(runs), 2)]
    assert all({a[0], b[0]} == {False, True} and a[1] == b[1] for a, b in pairs), "off and on back to back"
    firsts = {(batch, first_on) for (first_on, batch), _ in pairs}
    assert firsts == {(b, on) for b in range(3) for on in (False, True)}, "each batch goes first both ways"
