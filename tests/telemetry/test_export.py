"""Real exporters against real receivers, through the `ddtree` command."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from telemetry import semconv as sc
from tests.telemetry.otlp_receiver import OtlpReceiver


def ddtree(pair: tuple[Path, Path], env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    target, drafter = pair
    args = ["generate", "--model", str(target), "--drafter", str(drafter), "--max-new-tokens", "10", "--json"]
    full_env = {**os.environ, "DDTREE_DEBUG_METRICS": "1", "OTEL_METRICS_EXPORTER": "none", **env}
    return subprocess.run(
        [sys.executable, "-m", "ddtree.cli", *args, *extra], capture_output=True, text=True, env=full_env, timeout=120
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
    if shutil.which("jq"):
        jq = subprocess.run(["jq", "-c", ".event", str(log)], capture_output=True, text=True, check=True)
        assert len(jq.stdout.splitlines()) == len(lines)
    assert {line["trace_id"] for line in lines if line["event"] == sc.EVENT_STEP} == {request.trace_id}


def test_an_unreachable_endpoint_does_not_break_decoding(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port that nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path / "log.jsonl"
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "DDTREE_LOG_FILE": str(log),
    }
    plain = ddtree(tiny_dirs, {"DDTREE_DEBUG_METRICS": "0"}, "--prompt", "x")
    proc = ddtree(tiny_dirs, env, "--prompt", "x")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]
    dropped = [json.loads(line) for line in log.read_text().splitlines() if '"dropped"' in line]
    assert len(dropped) <= 1, "a failing exporter is logged once"


def test_a_silent_endpoint_cannot_hang_the_exit(tiny_dirs: tuple[Path, Path]) -> None:
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
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.getsockname()[1]}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        }
        proc = ddtree(tiny_dirs, env, "--prompt", "x")  # the subprocess timeout (120 s) fails the test if it hangs
        assert proc.returncode == 0, proc.stderr
        assert len(json.loads(proc.stdout)["token_ids"]) == 10
    finally:
        stop.set()
        server.close()
        for conn in accepted:
            conn.close()


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
