"""The held-out set: the pair loaded and the prompts encoded once, for both of `ddtree drafter eval`'s
measures; a target without a tokenizer is refused in words."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from ddtree.cli.main import main
from ddtree.data import heldout_prompts
from ddtree.models import pair
from ddtree.models.chat import chat_ids
from ddtree.train.heldout import HeldoutSet


def test_both_measures_share_one_loaded_pair(
    tiny_dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    loads: list[tuple[Any, ...]] = []
    real = pair.load_models
    monkeypatch.setattr(pair, "load_models", lambda *a, **k: (loads.append(a), real(*a, **k))[1])
    target, drafter = tiny_dirs
    argv = ["drafter", "eval", str(drafter), "--model", str(target), "--device", "cpu", "--num-prompts", "2"]
    assert main([*argv, "--max-new-tokens", "4", "--decoded", "--json"]) == 0
    assert len(loads) == 1, "the decoded measure reuses the teacher-forced one's pair"
    assert '"decoded"' in capsys.readouterr().out


def test_the_set_holds_the_first_prompts_in_chat_form(tiny_dirs: tuple[Path, Path]) -> None:
    target, drafter = tiny_dirs
    held = HeldoutSet.load(str(target), str(drafter), "cpu", prompts=3)
    assert held.prompts == [chat_ids(held.tokenizer, p) for p in heldout_prompts()[:3]]
    assert held.drafter.target_layer_ids == held.target.feature_layers


def test_a_target_without_a_tokenizer_is_refused(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = tiny_dirs
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in target.iterdir():
        if "token" not in f.name and f.is_file():
            shutil.copy(f, bare / f.name)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        HeldoutSet.load(str(bare), str(drafter), "cpu")
