from __future__ import annotations

import os
from pathlib import Path

# On CPU the Triton kernels run in Triton's interpreter. The variable must be set before anything imports
# triton (torch may, on its own): triton's standard library is decorated for one mode at import time.
if os.environ.get("DDTREE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from ddtree.cli.main import main
from tests.tools import MISSING_TOOL


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random tiny target and drafter on disk, written by the CLI itself."""
    root = tmp_path_factory.mktemp("pair")
    target, drafter = root / "target", root / "drafter"
    assert main(["models", "init-tiny", "--out", str(target), "--hidden-size", "32", "--num-layers", "2"]) == 0
    assert main(["drafter", "init", "--target", str(target), "--out", str(drafter), "--block-size", "5"]) == 0
    return target, drafter


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`DDTREE_TEST_ORDER=reverse` runs the collected tests last to first: a test that passes only after (or
    before) another shows up as a failure in one of the two orders."""
    if os.environ.get("DDTREE_TEST_ORDER") == "reverse":
        items.reverse()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line, just above pytest's own summary, naming the tools whose tests were skipped."""
    tools: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
        if MISSING_TOOL in reason:
            tool = reason.split(MISSING_TOOL, 1)[1].split()[0]
            tools[tool] = tools.get(tool, 0) + 1
    if tools:
        listed = ", ".join(f"{tool} ({n} skipped)" for tool, n in sorted(tools.items()))
        terminalreporter.write_line(f"tests skipped for missing tools: {listed}", yellow=True, bold=True)
