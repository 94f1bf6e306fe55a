"""`scripts/mutants.py` patches the source by exact text: a refactor that changes a mutated line must update the
mutant with it, or CI's mutation run stops at that mutant. This checks every edit in seconds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _mutants_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutants_script", ROOT / "scripts" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_every_mutant_edit_occurs_once_in_the_source() -> None:
    mutants = _mutants_module()
    assert mutants.stale_edits(ROOT, mutants._mutants()) == []


def test_a_moved_line_is_reported(tmp_path: Path) -> None:
    mutants = _mutants_module()
    chosen = mutants._mutants()[0]
    (tmp_path / chosen.path).parent.mkdir(parents=True)
    (tmp_path / chosen.path).write_text("the mutated line is gone\n")
    stale = mutants.stale_edits(tmp_path, [chosen])
    assert len(stale) == len(chosen.edits) and chosen.name in stale[0] and "0 times" in stale[0]
