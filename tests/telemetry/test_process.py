"""The exporter process: what the decode process sends reaches the sinks there, its failures stay there, and
no sink can stall decoding."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ddtree.engine.engine import Engine
from ddtree.settings import GenerationConfig
from telemetry import TelemetryConfig, TelemetryConfigError, start_telemetry
from telemetry import semconv as sc
from telemetry.outbox import SEND_EVERY_STEPS
from tests.helpers import random_prompts, tiny_pair


def logged(tmp_path: Path, **kwargs: Any) -> TelemetryConfig:
    return TelemetryConfig(
        enabled=True,
        traces_exporter="none",
        metrics_exporter="none",
        log_file=kwargs.pop("log_file", str(tmp_path / "steps.jsonl")),
        **kwargs,
    )


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_step_reaches_the_exporter_process(tmp_path: Path) -> None:
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
    lines = read_lines(tmp_path / "steps.jsonl")
    steps = [line for line in lines if line["event"] == sc.EVENT_STEP]
    assert len(steps) == sum(r.steps for r in results)
    assert max(r.steps for r in results) > SEND_EVERY_STEPS, "a full group is sent while a request decodes"
    emitted = sum(sum(s[sc.FIELD_EMITTED]) for s in steps)
    requests = [line for line in lines if line["event"] == sc.EVENT_REQUEST]
    assert len(requests) == 6
    assert emitted + len(requests) == sum(r.new_tokens for r in results), "steps plus each first token"
    assert telemetry.dropped() == {sc.DROPPED_STEP: 0, sc.DROPPED_REQUEST: 0}


def test_a_start_up_error_in_the_exporter_process_is_a_clear_error(tmp_path: Path) -> None:
    config = TelemetryConfig(enabled=True, traces_exporter="none", log_file=str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(TelemetryConfigError, match="not writable"):
        start_telemetry(config)


def test_an_exporter_package_that_does_not_import_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exporter process imports the OTLP exporter of the configured protocol: where that package is
    broken or missing, the error names it (the process inherits our import path, with a broken copy first)."""
    broken = tmp_path / "site" / "opentelemetry" / "exporter" / "otlp" / "proto" / "http"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken install')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    config = TelemetryConfig(
        enabled=True, metrics_exporter="none", otlp_protocol="http/protobuf", log_file=str(tmp_path / "steps.jsonl")
    )
    with pytest.raises(TelemetryConfigError, match="needs the package opentelemetry-exporter-otlp-proto-http"):
        start_telemetry(config)


def test_an_exporter_process_that_fails_says_it_exited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that fails outside the config check (here the exporter module itself does not import, and its
    process takes a second to end after closing its socket, as one tearing down torch does): the error gives
    the process's exit code, not 'did not answer'."""
    broken = tmp_path / "site" / "telemetry"
    broken.mkdir(parents=True)
    ending = "import os, sys, time\nos.close(int(sys.argv[1]))\ntime.sleep(1)\nraise SystemExit(3)\n"
    (broken / "__init__.py").write_text(ending)
    monkeypatch.setenv("PYTHONSAFEPATH", "1")  # the working directory, which holds the real one, does not come first
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(TelemetryConfigError, match="exited with code 3"):
        start_telemetry(logged(tmp_path))


def test_decoding_goes_on_when_the_exporter_process_dies_and_every_loss_is_counted(tmp_path: Path) -> None:
    target, drafter = tiny_pair(4, vocab=16)
    prompts = random_prompts(4, 2, vocab=16)
    config = GenerationConfig(budget=8, max_new_tokens=12)
    plain = Engine(target, drafter).generate(prompts, config)
    telemetry = start_telemetry(logged(tmp_path))
    exporter: Any = telemetry.observer.sinks[0]
    exporter.process.kill()
    exporter.process.wait()
    try:
        out = Engine(target, drafter, observer=telemetry.observer).generate(prompts, config)
    finally:
        telemetry.shutdown()
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in plain.outputs]
    # Nothing reached a dead process: every step and each request's start and end are counted.
    assert telemetry.dropped() == {sc.DROPPED_STEP: out.steps, sc.DROPPED_REQUEST: 2 * len(prompts)}


def test_a_named_pipe_that_no_one_reads_is_a_clear_error_at_once(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "log.pipe"
    os.mkfifo(fifo)
    with pytest.raises(TelemetryConfigError, match="named pipe that no process reads"):
        start_telemetry(logged(tmp_path, log_file=str(fifo)))


def test_a_large_budget_generate_logs_every_step(tmp_path: Path) -> None:
    """B=256 with two prompts (the largest records a step sends): every step and both requests reach the log,
    and the steps' tau is the requests' own."""
    target, drafter = tiny_pair(9, vocab=16)
    telemetry = start_telemetry(logged(tmp_path))
    result = Engine(target, drafter, observer=telemetry.observer).generate(
        random_prompts(9, 2, vocab=16), GenerationConfig(budget=256, max_new_tokens=48)
    )
    telemetry.shutdown()
    lines = read_lines(tmp_path / "steps.jsonl")
    steps = [line for line in lines if line["event"] == sc.EVENT_STEP]
    assert sorted(line[sc.FIELD_STEP] for line in steps) == list(range(result.steps))
    per_request = sum(len(line[sc.FIELD_REQUEST_IDS]) for line in steps)
    assert per_request == sum(len(o.acceptance_lengths) for o in result.outputs)
    assert max(line[sc.FIELD_TREE_NODES][0] for line in steps) > 64, "the trees are large"


def test_an_adaptive_steps_width_and_gain_reach_the_exporter_process(tmp_path: Path) -> None:
    target, drafter = tiny_pair(0, vocab=8, block_size=5)
    telemetry = start_telemetry(logged(tmp_path))
    engine = Engine(target, drafter, observer=telemetry.observer)
    result = engine.generate(
        random_prompts(0, 2, vocab=8), GenerationConfig(budget=8, adaptive=True, max_new_tokens=16)
    )
    telemetry.shutdown()
    steps = [line for line in read_lines(tmp_path / "steps.jsonl") if line["event"] == sc.EVENT_STEP]
    assert len(steps) == result.steps and all(s[sc.FIELD_PREDICTED_GAIN] >= 1.0 for s in steps)
    widths = sorted({b for o in result.outputs for b in o.budgets})
    assert sorted({s[sc.FIELD_BUDGET] for s in steps}) == widths  # each step's width, not the widest
    assert all(sc.STAGE_DECIDE in s[sc.FIELD_STAGE_MS] for s in steps)
