"""`benchmarks/bench_serve.py --serve LABEL=ARGS`: the label may hold `=` (`B=16`), the flags are split as a
shell would, and a spec without flags is refused."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench_serve() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serve_script", ROOT / "benchmarks" / "bench_serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_a_label_may_hold_an_equals_sign() -> None:
    parse = _bench_serve()._server_spec
    assert parse("B=16=--budget 16") == ("B=16", ["--budget", "16"])
    assert parse("ar=--method ar") == ("ar", ["--method", "ar"])
    assert parse("auto=--budget-schedule 'my file.json'") == ("auto", ["--budget-schedule", "my file.json"])


def test_a_spec_without_flags_is_refused() -> None:
    with pytest.raises(SystemExit, match="LABEL=ARGS"):
        _bench_serve()._server_spec("B=16")
