"""Every Grafana panel's PromQL, run by a real Prometheus that scrapes a live `DDTREE_DEBUG_METRICS=1 ddtree
serve` under concurrent load: each query must parse and return data. The GPU panels need NVML on a CUDA
device, which CI does not have: here they must parse, and `tests/dashboards` checks their names and labels
against a live exporter with a stand-in NVML."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ddtree.server.app import create_app
from ddtree.server.model import load_model
from telemetry import semconv as sc
from tests import tools
from tests.ddtree.server.conftest import settings_for
from tests.ddtree.server.support import live_server
from tests.telemetry import test_prometheus as prom
from tests.telemetry.live import dead_endpoint

DASHBOARD = Path(__file__).resolve().parents[3] / "dashboards" / "grafana-ddtree.json"
PROMPTS = ["the draft tree", "grows from the root", "and the target", "checks every node", "x", "a b c d e f"]


def _panels() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def _ask(url: str, prompt: str) -> int:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["completion_tokens"])


def _value(port: int, promql: str) -> float | None:
    try:
        rows = prom._query(port, promql)
    except OSError:  # Prometheus is still starting
        return None
    return float(rows[0]["value"][1]) if rows else None  # type: ignore[index]


def _wait(done: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.5)
    raise AssertionError("timed out")


@tools.PROMETHEUS
def test_every_panel_query_returns_data_from_a_served_run(
    tiny_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "DDTREE_DEBUG_METRICS": "1",
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": dead_endpoint(),  # spans are dropped and counted: the drops panel
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "DDTREE_LOG_FILE": str(tmp_path / "steps.jsonl"),
    }.items():
        monkeypatch.setenv(name, value)
    prometheus = shutil.which("prometheus")
    assert prometheus is not None
    settings = settings_for(tiny_dirs, max_batch_size=4)
    served = load_model(settings)
    port = prom._free_port()
    with live_server(create_app(settings, served)) as (url, _, _):
        (tmp_path / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: ddtree\n    static_configs:\n"
            f"      - targets: ['{url.removeprefix('http://')}']\n"
        )
        argv = [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait(lambda: _value(port, 'up{job="ddtree"}') == 1.0)
            with ThreadPoolExecutor(4) as pool:  # concurrent requests: batched steps
                served_tokens = sum(pool.map(lambda p: _ask(url, p), PROMPTS * 2))
            assert served_tokens > 2 * len(PROMPTS)  # tokens past each request's first one came from steps
            _wait(lambda: (_value(port, f"sum({sc.PROM_EMITTED_TOKENS_TOTAL})") or 0) > 0)
            _wait(lambda: _value(port, "sum(ddtree_dropped_spans_total)") is not None)
            time.sleep(3)  # a few more scrapes: every rate() has two samples in its window
            empty = []
            for title, expr in _panels():
                rows = prom._query(port, expr)  # asserts that Prometheus accepted the query
                if not rows and not title.startswith("GPU"):
                    empty.append(title)
            assert not empty, f"panels without data: {empty}"
        finally:
            server.terminate()
            server.wait(timeout=10)
