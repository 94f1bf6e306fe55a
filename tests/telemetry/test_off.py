"""Off means off: no OpenTelemetry import, and a step calls nothing of telemetry's but the no-op hooks."""

from __future__ import annotations

import subprocess
import sys
from types import FrameType
from typing import Any

from ddtree.engine.engine import Engine
from ddtree.observer import NOOP
from ddtree.settings import GenerationConfig
from telemetry import start_telemetry
from telemetry.config import TelemetryConfig
from tests.helpers import random_prompts, tiny_pair


def test_nothing_from_opentelemetry_is_imported_when_off() -> None:
    code = (
        "import sys, os\n"
        "os.environ.pop('DDTREE_DEBUG_METRICS', None)\n"
        "from ddtree.runtime import run_generate\n"
        "from telemetry import start_telemetry\n"
        "t = start_telemetry()\n"
        "assert t.observer.__class__.__name__ == 'NoopObserver'\n"
        "bad = [m for m in sys.modules if m.startswith(('opentelemetry', 'prometheus_client', 'structlog'))]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_step_calls_only_the_noop_hooks() -> None:
    assert start_telemetry(TelemetryConfig(enabled=False)).observer is NOOP
    target, drafter = tiny_pair(0, vocab=16)
    engine = Engine(target, drafter)
    prompts = random_prompts(0, 2, vocab=16)
    config = GenerationConfig(method="ddtree", budget=8, max_new_tokens=10)
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_globals.get("__name__", "").startswith(("telemetry", "ddtree.observer")):
            calls.append(f"{frame.f_globals['__name__']}.{frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        result = engine.generate(prompts, config)
    finally:
        sys.setprofile(None)
    hooks = {
        f"ddtree.observer.NoopObserver.on_{h}"
        for h in ("step_start", "stage_start", "stage_end", "tree", "accept", "step_end")
    }
    assert set(calls) <= hooks, set(calls) - hooks
    assert calls.count("ddtree.observer.NoopObserver.on_step_start") == result.steps
