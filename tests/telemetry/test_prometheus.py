"""A real Prometheus server (Debian's `prometheus`, installed by .ci/run) scrapes our exporter."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from ddtree.engine.engine import Engine
from ddtree.settings import GenerationConfig
from telemetry import semconv as sc
from telemetry import start_telemetry
from telemetry.config import TelemetryConfig
from tests import tools
from tests.helpers import random_prompts, tiny_pair

PROMETHEUS = shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _query(port: int, promql: str) -> list[dict[str, object]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = json.load(reply)
    assert body["status"] == "success"
    result: list[dict[str, object]] = body["data"]["result"]
    return result


@tools.PROMETHEUS
def test_prometheus_scrapes_the_counts(tmp_path: Path) -> None:
    assert PROMETHEUS is not None, "CI must install Debian's prometheus"
    config = TelemetryConfig(
        enabled=True,
        traces_exporter="none",
        metrics_exporter="prometheus",
        prometheus_port=0,
        log_file=str(tmp_path / "log"),
    )
    telemetry = start_telemetry(config)
    prom_port = _free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: ddtree\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{telemetry.prometheus_port}']\n"
    )
    server = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        target, drafter = tiny_pair(5, vocab=12, block_size=5)
        result = Engine(target, drafter, observer=telemetry.observer).generate(
            random_prompts(5, 3, vocab=12), GenerationConfig(method="ddtree", budget=16, max_new_tokens=20)
        )
        accepted = sum(a - 1 for o in result.outputs for a in o.acceptance_lengths)
        tokens = sum(len(o.token_ids) for o in result.outputs)
        assert accepted > 0
        expected = {
            f"sum({sc.PROM_ACCEPTED_TOKENS_TOTAL})": accepted,
            f"sum({sc.PROM_EMITTED_TOKENS_TOTAL})": tokens,
            f"sum({sc.PROM_STEPS_TOTAL})": result.steps,
            f"sum({sc.PROM_ACCEPTED_PER_DEPTH_TOTAL})": accepted,
        }
        deadline = time.monotonic() + 60
        seen: dict[str, float] = {}
        while time.monotonic() < deadline and seen != expected:
            time.sleep(1)
            try:
                for promql in expected:
                    rows = _query(prom_port, promql)
                    if rows:
                        seen[promql] = float(rows[0]["value"][1])  # type: ignore[index]
            except OSError:
                continue  # Prometheus is still starting
        assert seen == expected
        stages = _query(prom_port, f"count by (stage) ({sc.PROM_STAGE_DURATION_SECONDS}_count)")
        assert {row["metric"]["stage"] for row in stages} == set(sc.STAGES)  # type: ignore[index]
    finally:
        server.terminate()
        server.wait(timeout=10)
        telemetry.shutdown()
