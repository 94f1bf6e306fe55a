"""Opt-in: a real run's spans in Arize Phoenix, read back through its REST API (`scripts/phoenix_trace.py`).

Phoenix is heavy (its own virtualenv, `make setup-phoenix`), so it is kept out of the main install and out of
the default test run: this module runs only when `$DDTREE_PHOENIX_PYTHON` names a python that has it, e.g.
`DDTREE_PHOENIX_PYTHON=.venv-phoenix/bin/python .venv/bin/python -m pytest tests/telemetry/test_phoenix.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from telemetry import semconv as sc
from tests.tools import MISSING_TOOL

ROOT = Path(__file__).resolve().parents[2]
PHOENIX_PYTHON = os.environ.get("DDTREE_PHOENIX_PYTHON", "")

pytestmark = pytest.mark.skipif(
    not (PHOENIX_PYTHON and Path(PHOENIX_PYTHON).is_file()),
    reason=f"{MISSING_TOOL} phoenix (opt-in: make setup-phoenix, then DDTREE_PHOENIX_PYTHON=.venv-phoenix/bin/python)",
)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_steps_arrive_in_phoenix_with_their_stages(protocol: str, tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = tiny_dirs
    summary = tmp_path / "summary.json"
    shot = tmp_path / "step.png"
    browser = shutil.which("chromium") is not None and protocol == "grpc"  # one screenshot is enough
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "phoenix_trace.py"),
            *("--phoenix-python", PHOENIX_PYTHON, "--model", str(target), "--drafter", str(drafter)),
            *("--prompts", "2", "--max-new-tokens", "12", "--protocol", protocol, "--json", str(summary)),
            *(("--screenshot", str(shot)) if browser else ()),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(summary.read_text())
    assert found["problems"] == []
    steps = found["logged_steps"]
    assert steps > 0
    assert found["spans"][sc.SPAN_STEP] == steps
    assert found["spans"][sc.SPAN_REQUEST] == 2
    for stage in sc.STAGES:
        assert found["spans"][sc.stage_span_name(stage)] == steps
    if browser:
        png = shot.read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", png[16:24]) == (1500, 900)
        assert len(png) > 20_000  # a drawn page, not a blank one
