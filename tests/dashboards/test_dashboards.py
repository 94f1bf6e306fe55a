"""The dashboards query only what a live exporter serves: names and labels read from its /metrics over HTTP
while it runs (a decode with telemetry on, a dead trace endpoint so that drops are counted, and a stand-in
NVML for the GPU gauges), not from `telemetry.semconv`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from ddtree.engine.engine import Engine, GenerationConfig
from telemetry import TelemetryConfig, start_telemetry
from tests.helpers import random_prompts, tiny_pair
from tests.telemetry.live import STAND_IN_NVML, dead_endpoint, scrape_until

ROOT = Path(__file__).resolve().parents[2] / "dashboards"
Served = dict[str, set[str]]  # metric name -> the label names it is served with


def _exporter(tmp_path: Path, name: str, **fields: object) -> TelemetryConfig:
    base: dict[str, object] = {"enabled": True, "metrics_exporter": "prometheus", "prometheus_port": 0}
    return TelemetryConfig(**{**base, "log_file": str(tmp_path / f"{name}.jsonl"), **fields})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Served:
    tmp_path = tmp_path_factory.mktemp("live")
    (tmp_path / "pynvml.py").write_text(STAND_IN_NVML)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp_path))  # the exporter process imports the stand-in pynvml
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        decoding = start_telemetry(
            _exporter(tmp_path, "decode", otlp_protocol="http/protobuf", otlp_endpoint=dead_endpoint())
        )
        gpu = start_telemetry(_exporter(tmp_path, "gpu", traces_exporter="none", nvml_interval_ms=50), "cuda")
    try:
        target, drafter = tiny_pair(0, vocab=16)
        engine = Engine(target, drafter, observer=decoding.observer)
        engine.generate(random_prompts(0, 2, vocab=16), GenerationConfig(budget=8, max_new_tokens=10))
        samples = scrape_until(decoding.prometheus_port, lambda s: any("dropped" in n for n in s))
        samples |= scrape_until(gpu.prometheus_port, lambda s: any("gpu" in n for n in s))
    finally:
        decoding.shutdown()
        gpu.shutdown()
    names: Served = {}
    for name, rows in samples.items():
        names.setdefault(name, set()).update(*(labels for labels, _ in rows))
    return names


def _queries() -> list[str]:
    dashboard = json.loads((ROOT / "grafana-ddtree.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_grafana_queries_only_metrics_a_live_exporter_serves(served: Served) -> None:
    used = {name for expr in _queries() for name in re.findall(r"\bddtree_[a-z_]+", expr)}
    assert len(used) >= 10 and used <= set(served), sorted(used - set(served))


def test_grafana_groups_only_by_labels_the_metric_has(served: Served) -> None:
    grouped = 0
    for expr in _queries():
        for labels, inner in re.findall(r"by \(([^)]*)\)\s*\((.*?)\)\)", expr):
            (name,) = re.findall(r"\bddtree_[a-z_]+", inner)
            assert {x.strip() for x in labels.split(",")} <= served[name], expr
            grouped += 1
    assert grouped >= 3


def test_prometheus_config_scrapes_the_default_port() -> None:
    config = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9464"]
    assert TelemetryConfig.from_env({}).prometheus_port == 9464
