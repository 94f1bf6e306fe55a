"""docs/cli.md is what the parsers print: regenerated in memory, it must equal the file."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_cli_md_is_current() -> None:
    text = _script().render()
    current = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert current == text, "docs/cli.md is out of date: run python scripts/cli_reference.py"


def test_the_reference_does_not_depend_on_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    monkeypatch.setenv("COLUMNS", "40")
    narrow_terminal = script.render()
    assert narrow_terminal == script.render(columns=100) and os.environ["COLUMNS"] == "40"
    assert "## `ddtree drafter state import`" in narrow_terminal and "```text\nusage: ddtree bench" in narrow_terminal
    assert max(len(line) for line in narrow_terminal.splitlines()) <= 100, "help and examples fit 100 columns"
    assert script.render(columns=60) != narrow_terminal, "the width reaches argparse"
