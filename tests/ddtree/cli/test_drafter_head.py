"""`ddtree drafter train-head`: a head written beside a copy of the drafter, which `drafter eval` then measures
with and without it (its teacher-forced tau the decoded one); bad input is one line and exit 2."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ddtree.cli.main import main
from ddtree.models.markov import HEAD_NAME


def _data(path: Path, vocab: int) -> Path:
    rng = random.Random(0)
    rows = [{"ids": [rng.randrange(vocab) for _ in range(40)], "prompt_len": 8} for _ in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_train_head_writes_a_head_that_eval_measures_with_and_without(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = tiny_dirs
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    out = tmp_path / "headed"
    argv = [
        "drafter",
        "train-head",
        str(drafter),
        "--model",
        str(target),
        "--data",
        str(_data(tmp_path / "d.jsonl", vocab)),
    ]
    assert main([*argv, "--out", str(out), "--rank", "4", "--steps", "30", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["train_samples"] > 0 and report["valid_samples"] > 0 and report["rank"] == 4
    assert report["valid_loss_marginal"] > 0 and report["valid_loss_head"] > 0
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", HEAD_NAME}
    assert not (drafter / HEAD_NAME).exists(), "the source drafter is left alone"
    evaluate = ["drafter", "eval", str(out), "--model", str(target), "--device", "cpu", "--num-prompts", "3"]
    for extra in ([], ["--no-head"]):
        assert main([*evaluate, *extra, "--max-new-tokens", "6", "--budgets", "8", "--decoded", "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        ours, decoded = result["teacher-forced"]["tau"], result["decoded"]["tau"]
        assert ours["ddtree B=8"] == pytest.approx(decoded["ddtree B=8"], rel=1e-9)


def test_train_head_on_data_it_cannot_read_exits_2_with_one_line(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, drafter = tiny_dirs
    argv = ["drafter", "train-head", str(drafter), "--model", str(target), "--data", str(tmp_path / "none.jsonl")]
    assert main([*argv, "--out", str(tmp_path / "o"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ddtree: error: ") and "none.jsonl" in err and len(err.splitlines()) == 1
