"""Tests that need a tool from outside Python skip loudly where it is missing: the reason names the tool and
the Debian package, pytest prints it in the short summary (`-rs` in addopts), and `tests/conftest.py` adds
one line listing the missing tools. In CI (`$CI` set), where `.ci/run` installs them, they fail instead."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

MISSING_TOOL = "missing tool:"


def needs(tool: str, package: str, path: str | None = None) -> pytest.MarkDecorator:
    """Skip unless `tool` is on PATH (or the file `path` exists); never skip in CI."""
    present = Path(path).is_file() if path else shutil.which(tool) is not None
    reason = f"{MISSING_TOOL} {tool} (Debian's {package}; .ci/run installs it)"
    return pytest.mark.skipif(not present and not os.environ.get("CI"), reason=reason)


PROMETHEUS = needs("prometheus", "prometheus")
JQ = needs("jq", "jq")
WORD_LIST = needs("/usr/share/dict/words", "wamerican", "/usr/share/dict/words")
