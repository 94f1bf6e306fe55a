"""Real exporters against real receivers, through the `ddtree` command."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddtree.engine.engine import Engine
from ddtree.settings import GenerationConfig
from telemetry import TelemetryConfig, start_telemetry
from telemetry import semconv as sc
from tests import tools
from tests.helpers import random_prompts, tiny_pair
from tests.telemetry.live import dead_endpoint, scrape_until, total
from tests.telemetry.otlp_receiver import OtlpReceiver

SHUTDOWN_PROMISE_S = 3.0  # `Telemetry.shutdown` bounds the whole of it (README: "shutdown is bounded (3 s)")
SHUTDOWN_MARGIN_S = 1.5  # a loaded machine; without the bound, a silent endpoint holds it for 5 s and more


def ddtree(pair: tuple[Path, Path], env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    target, drafter = pair
    args = ["generate", "--model", str(target), "--drafter", str(drafter), "--max-new-tokens", "10", "--json"]
    full_env = {**os.environ, "DDTREE_DEBUG_METRICS": "1", "OTEL_METRICS_EXPORTER": "none", **env}
    return subprocess.run(
        [sys.executable, "-m", "ddtree.cli", *args, *extra], capture_output=True, text=True, env=full_env, timeout=60
    )


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_spans_reach_a_real_otlp_receiver(tiny_dirs: tuple[Path, Path], tmp_path: Path, protocol: str) -> None:
    receiver = OtlpReceiver()
    endpoint = receiver.start_grpc() if protocol == "grpc" else receiver.start_http()
    log = tmp_path / "steps.jsonl"
    try:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_SERVICE_NAME": "ddtree-test",
            "DDTREE_LOG_FILE": str(log),
        }
        proc = ddtree(tiny_dirs, env, "--prompt", "one", "--budget", "8")
        assert proc.returncode == 0, proc.stderr
    finally:
        receiver.close()
    output = json.loads(proc.stdout)
    spans = receiver.spans
    steps = [s for s in spans if s.name == sc.SPAN_STEP]
    requests = [s for s in spans if s.name == sc.SPAN_REQUEST]
    assert len(steps) == output["steps"] and len(requests) == 1
    request = requests[0]
    assert request.service == "ddtree-test"
    assert request.attributes[sc.GEN_AI_OPERATION_NAME] == sc.GEN_AI_OPERATION_TEXT_COMPLETION
    assert request.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] == len(output["token_ids"])
    assert sc.GEN_AI_PROMPT not in request.attributes
    for step in steps:
        assert step.parent_span_id == request.span_id and step.trace_id == request.trace_id
        assert step.attributes[sc.ATTR_METHOD] == "ddtree" and step.attributes[sc.ATTR_BUDGET] == 8
        children = [s for s in spans if s.parent_span_id == step.span_id]
        assert sorted(c.name for c in children) == sorted(sc.stage_span_name(x) for x in sc.STAGES)
        assert all(step.start_ns <= c.start_ns <= c.end_ns <= step.end_ns for c in children)
    accepted = sum(s.attributes[sc.ATTR_ACCEPTED_TOKENS] for s in steps)
    assert accepted == sum(a - 1 for a in output["acceptance_lengths"])
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert {line["trace_id"] for line in lines if line["event"] == sc.EVENT_STEP} == {request.trace_id}


def test_an_unreachable_endpoint_costs_no_tokens_and_its_drops_are_counted_and_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export (and fail) while decoding, not only at exit
    log = tmp_path / "log.jsonl"
    config = TelemetryConfig(
        enabled=True,
        otlp_protocol="http/protobuf",
        otlp_endpoint=dead_endpoint(),
        metrics_exporter="prometheus",
        prometheus_port=0,
        log_file=str(log),
    )
    target, drafter = tiny_pair(6, vocab=16)
    prompts, generation = random_prompts(6, 2, vocab=16), GenerationConfig(budget=8, max_new_tokens=12)
    plain = Engine(target, drafter).generate(prompts, generation)
    telemetry = start_telemetry(config)
    try:
        result = Engine(target, drafter, observer=telemetry.observer).generate(prompts, generation)
        spans = result.steps * (1 + len(sc.STAGES)) + len(prompts)  # a step span, its stages; a request span
        dropped = sc.METRIC_DROPPED_SPANS + "_total"
        samples = scrape_until(telemetry.prometheus_port, lambda s: total(s, dropped) >= spans)
    finally:
        telemetry.shutdown()
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in plain.outputs]
    assert total(samples, dropped) == spans, "every span that could not be exported is counted"
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    failures = [x for x in lines if x["event"] == sc.EVENT_TELEMETRY and x.get("export") == "failed"]
    assert len(failures) == 1, "a failing exporter is logged once"
    assert failures[0][sc.FIELD_EXPORT_SIGNAL] == "traces"
    assert failures[0][sc.FIELD_EXPORT_ENDPOINT] == config.otlp_endpoint + "/v1/traces"
    assert "Connection refused" in failures[0][sc.FIELD_EXPORT_CAUSE], "the cause, not only that it failed"
    said = [line for line in capfd.readouterr().err.splitlines() if "export to" in line]
    assert len(said) == 1 and failures[0][sc.FIELD_EXPORT_ENDPOINT] in said[0], "and once on stderr"


@contextlib.contextmanager
def silent_endpoint() -> Iterator[tuple[str, list[socket.socket]]]:
    """An endpoint that accepts connections and never answers; its URL and the connections it took."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_say_nothing() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}", accepted
    finally:
        stop.set()
        server.close()
        for conn in accepted:
            conn.close()


def test_shutdown_with_a_silent_endpoint_keeps_its_promised_bound(tmp_path: Path) -> None:
    """The exporter is stuck sending to an endpoint that never answers; `shutdown` returns within the 3 s it
    promises (plus a margin for a loaded machine), not after the SDK's export timeout and retries."""
    with silent_endpoint() as (url, accepted):
        config = TelemetryConfig(
            enabled=True,
            otlp_protocol="http/protobuf",
            otlp_endpoint=url,
            metrics_exporter="none",
            log_file=str(tmp_path / "log.jsonl"),
        )
        telemetry = start_telemetry(config)
        target, drafter = tiny_pair(6, vocab=16)
        Engine(target, drafter, observer=telemetry.observer).generate([[1, 2, 3]], GenerationConfig(max_new_tokens=8))
        started = time.monotonic()
        telemetry.shutdown()
        took = time.monotonic() - started
        assert accepted, "the exporter did reach the silent endpoint"
    assert took < SHUTDOWN_PROMISE_S + SHUTDOWN_MARGIN_S, f"shutdown took {took:.1f} s"


def test_a_silent_endpoint_cannot_hang_the_exit(tiny_dirs: tuple[Path, Path]) -> None:
    with silent_endpoint() as (url, _):
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
        proc = ddtree(tiny_dirs, env, "--prompt", "x")  # the subprocess timeout fails the test if it hangs
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 10


@tools.JQ
def test_step_logs_read_with_jq(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    env = {"OTEL_TRACES_EXPORTER": "none", "DDTREE_LOG_FILE": str(log)}
    proc = ddtree(tiny_dirs, env, "--prompt", "one", "--budget", "8")
    assert proc.returncode == 0, proc.stderr
    steps = json.loads(proc.stdout)["steps"]
    jq = subprocess.run(
        ["jq", "-c", f'select(.event == "{sc.EVENT_STEP}") | .emitted | add', str(log)],
        capture_output=True,
        text=True,
        check=True,
    )
    emitted = [int(x) for x in jq.stdout.split()]
    assert len(emitted) == steps and sum(emitted) + 1 == 10, "every step line, and the tokens they emitted"


def test_an_unwritable_log_file_is_a_clear_error(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    proc = ddtree(
        tiny_dirs,
        {"DDTREE_LOG_FILE": str(tmp_path / "missing" / "dir" / "log"), "OTEL_TRACES_EXPORTER": "none"},
        "--prompt",
        "x",
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("ddtree: error: DDTREE_LOG_FILE") and "Traceback" not in proc.stderr


def test_a_bad_flag_is_a_clear_error(tiny_dirs: tuple[Path, Path]) -> None:
    proc = ddtree(tiny_dirs, {"DDTREE_DEBUG_METRICS": "on"}, "--prompt", "x")
    assert proc.returncode == 2 and "DDTREE_DEBUG_METRICS must be 0, 1, true or false" in proc.stderr


def test_a_closed_stdout_ends_cleanly(tiny_dirs: tuple[Path, Path]) -> None:
    target, drafter = tiny_dirs
    cmd = (
        f"{sys.executable} -m ddtree.cli generate --model {target} --drafter {drafter} --max-new-tokens 5 --json "
        + " ".join(["--prompt x"] * 40)
        + " | head -c 10"
    )
    env = {
        **os.environ,
        "DDTREE_DEBUG_METRICS": "1",
        "DDTREE_LOG_FILE": "-",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
    }
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_a_failing_metric_export_says_where_and_why_once(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.jsonl"
    config = TelemetryConfig(
        enabled=True,
        traces_exporter="none",
        otlp_protocol="http/protobuf",
        otlp_endpoint=dead_endpoint(),
        metrics_exporter="otlp",
        log_file=str(log),
    )
    telemetry = start_telemetry(config)
    target, drafter = tiny_pair(6, vocab=16)
    Engine(target, drafter, observer=telemetry.observer).generate([[1, 2, 3]], GenerationConfig(max_new_tokens=8))
    telemetry.shutdown(timeout_s=30)  # the last collection is exported at shutdown, and fails
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    failures = [x for x in lines if x["event"] == sc.EVENT_TELEMETRY and x.get("export") == "failed"]
    assert [x[sc.FIELD_EXPORT_SIGNAL] for x in failures] == ["metrics"]
    assert failures[0][sc.FIELD_EXPORT_ENDPOINT] == config.otlp_endpoint + "/v1/metrics"
    assert "Connection refused" in failures[0][sc.FIELD_EXPORT_CAUSE]
    assert sum("metrics export to" in line for line in capfd.readouterr().err.splitlines()) == 1
