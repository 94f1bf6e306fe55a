from __future__ import annotations

import json
from pathlib import Path

import pytest

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
