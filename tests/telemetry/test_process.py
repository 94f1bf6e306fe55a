"""The exporter process: what the decode process sends reaches the sinks there, and its failures stay there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ddtree.engine.decode import Engine, GenerationConfig
from telemetry import TelemetryConfig, TelemetryConfigError, start_telemetry
from telemetry import semconv as sc
from telemetry.process import SEND_EVERY_STEPS
from tests.helpers import random_prompts, tiny_pair


def logged(tmp_path: Path) -> TelemetryConfig:
    return TelemetryConfig(
        enabled=True, traces_exporter="none", metrics_exporter="none", log_file=str(tmp_path / "steps.jsonl")
    )


def test_every_step_reaches_the_exporter_process(tmp_path: Path) -> None:
    """With a core left to it: the exporter runs at idle priority, so on a machine whose every core decodes it
    may get no CPU at all, fall behind, and have steps dropped by design (the next test)."""
    target, drafter = tiny_pair(3, vocab=16)
    telemetry = start_telemetry(logged(tmp_path))
    engine = Engine(target, drafter, observer=telemetry.observer)
    config = GenerationConfig(budget=8, max_new_tokens=40)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = [engine.generate(random_prompts(seed, 3, vocab=16), config) for seed in range(2)]
    finally:
        torch.set_num_threads(threads)
    telemetry.shutdown()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line["event"] == sc.EVENT_STEP]
    assert len(steps) == sum(r.steps for r in results)
    assert max(r.steps for r in results) > SEND_EVERY_STEPS, "a full group is sent while a request decodes"
    emitted = sum(sum(s[sc.FIELD_EMITTED]) for s in steps)
    requests = [line for line in lines if line["event"] == sc.EVENT_REQUEST]
    assert len(requests) == 6
    assert emitted + len(requests) == sum(r.new_tokens for r in results), "steps plus each first token"


def test_a_start_up_error_in_the_exporter_process_is_a_clear_error(tmp_path: Path) -> None:
    config = TelemetryConfig(enabled=True, traces_exporter="none", log_file=str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(TelemetryConfigError, match="not writable"):
        start_telemetry(config)


def test_decoding_goes_on_when_the_exporter_process_dies(tmp_path: Path) -> None:
    target, drafter = tiny_pair(4, vocab=16)
    prompts = random_prompts(4, 2, vocab=16)
    config = GenerationConfig(budget=8, max_new_tokens=12)
    plain = Engine(target, drafter).generate(prompts, config)
    telemetry = start_telemetry(logged(tmp_path))
    exporter: Any = telemetry.observer.sinks[0]
    exporter.process.kill()
    exporter.process.wait()
    try:
        with pytest.warns(UserWarning, match="ExporterProcess failed and is off"):
            out = Engine(target, drafter, observer=telemetry.observer).generate(prompts, config)
    finally:
        telemetry.shutdown()
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in plain.outputs]


def test_steps_are_dropped_not_waited_for_when_the_exporter_is_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from telemetry import process

    target, drafter = tiny_pair(5, vocab=16)
    telemetry = start_telemetry(logged(tmp_path))
    monkeypatch.setattr(process.select, "select", lambda r, w, x, t: ([], [], []))  # never writable
    try:
        with pytest.warns(UserWarning, match="behind"):
            result = Engine(target, drafter, observer=telemetry.observer).generate(
                [[1, 2, 3]], GenerationConfig(budget=8, max_new_tokens=30)
            )
    finally:
        monkeypatch.undo()
        telemetry.shutdown()
    assert result.steps > 0
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert not any(sc.EVENT_STEP in line for line in lines), "dropped, not sent"
    assert sum(sc.EVENT_REQUEST in line for line in lines) == 1, "the request line still arrives"
