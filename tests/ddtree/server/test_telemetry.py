"""`DDTREE_DEBUG_METRICS=1 ddtree serve`: step telemetry under continuous batching, through the one /metrics."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from ddtree.server.app import create_app
from ddtree.server.model import load_model
from telemetry import semconv as sc
from tests.ddtree.server.conftest import settings_for


def _emitted_total(metrics_text: str) -> float:
    """The telemetry layer's emitted-tokens counter in Prometheus text (0 before it arrives)."""
    pattern = rf"^{sc.PROM_EMITTED_TOKENS_TOTAL}\{{[^}}]*\}} ([0-9.e+]+)$"
    return sum(float(v) for v in re.findall(pattern, metrics_text, flags=re.M))


def test_debug_metrics_follow_requests_through_the_server(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "steps.jsonl"
    for name, value in {
        "DDTREE_DEBUG_METRICS": "1",
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "prometheus",
        "DDTREE_LOG_FILE": str(log),
        "DDTREE_NVML_INTERVAL_MS": "0",
    }.items():
        monkeypatch.setenv(name, value)
    settings = settings_for(tiny_dirs)
    served = load_model(settings)
    served_tokens: dict[str, int] = {}
    with TestClient(create_app(settings, served)) as client:
        for prompt, tokens in (("abc", 12), ("hello there", 20), ("x", 7)):
            body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": tokens, "temperature": 0})
            assert body.status_code == 200, body.text
            served_tokens[body.json()["id"]] = body.json()["usage"]["completion_tokens"]
        deadline, text = time.monotonic() + 10, ""
        while time.monotonic() < deadline:  # the exporter process gets steps in groups, within about a second
            text = client.get("/metrics").text
            if _emitted_total(text) == sum(served_tokens.values()):
                break
            time.sleep(0.2)
        assert sc.PROM_HTTP_REQUESTS_TOTAL in text, "the server's own metrics"
        assert _emitted_total(text) == sum(served_tokens.values()), "telemetry's, through the same endpoint"
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    requests = {line[sc.FIELD_REQUEST_ID]: line for line in lines if line["event"] == sc.EVENT_REQUEST}
    assert {rid: r[sc.FIELD_OUTPUT_TOKENS] for rid, r in requests.items()} == served_tokens
    steps = [line for line in lines if line["event"] == sc.EVENT_STEP]
    assert {rid for s in steps for rid in s[sc.FIELD_REQUEST_IDS]} == set(served_tokens)
    for rid, tokens in served_tokens.items():  # the prefill gives each request its first token
        emitted = [
            e for s in steps for r, e in zip(s[sc.FIELD_REQUEST_IDS], s[sc.FIELD_EMITTED], strict=True) if r == rid
        ]
        assert sum(emitted) + 1 == tokens, rid
