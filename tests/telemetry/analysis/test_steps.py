from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.cli.main import main
from ddtree.engine.engine import Engine
from ddtree.settings import GenerationConfig
from telemetry.analysis.steps import advice, read_steps, summarise
from tests.helpers import random_prompts, tiny_pair
from tests.telemetry.helpers import captured_telemetry


def test_analysis_reproduces_tau_and_picks_the_fastest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target, drafter = tiny_pair(3, vocab=12, block_size=5)
    captured = captured_telemetry()
    engine = Engine(target, drafter, observer=captured.collector)
    prompts = random_prompts(3, 2, vocab=12)
    taus = {}
    for budget in (2, 16):
        out = engine.generate(prompts, GenerationConfig(method="ddtree", budget=budget, max_new_tokens=20))
        lengths = [a for o in out.outputs for a in o.acceptance_lengths]
        taus[budget] = sum(lengths) / len(lengths)
    log = tmp_path / "log.jsonl"
    log.write_text(captured.log.getvalue() + "not json\n")
    groups = summarise(read_steps(log))
    assert [(g.method, g.budget) for g in groups] == [("ddtree", 2), ("ddtree", 16)]
    for g in groups:
        assert g.tau == pytest.approx(taus[g.budget])
        assert min(g.depth_acceptance()) >= 0.0 and max(g.depth_acceptance()) <= 1.0
    best = max(groups, key=lambda g: g.tokens_per_second)
    assert advice(groups).startswith(f"fastest: {best.label}")
    assert main(["analyze", str(log)]) == 0
    assert "ddtree B=16" in capsys.readouterr().out


def test_analyze_without_step_lines_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"event": "other"}\n')
    assert main(["analyze", str(empty)]) == 2
    assert main(["analyze", str(tmp_path / "missing")]) == 2
    assert "cannot read" in capsys.readouterr().err
