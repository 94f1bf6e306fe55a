"""The dashboards query only what a served run serves (names and labels read from a live `ddtree serve` with
DDTREE_DEBUG_METRICS=1 and a stand-in GPU exporter over HTTP, not from `telemetry.semconv`); every panel's
query, run by a real Prometheus scraping them under load, returns data; the dashboard asks for its data
source on import; and the shipped `prometheus.yml` scrapes the server as the README starts it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import yaml

from ddtree.cli.main import build_parser
from telemetry import TelemetryConfig
from tests import tools
from tests.dashboards.conftest import Run, prometheus, query, wait_for

ROOT = Path(__file__).resolve().parents[2] / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
NAME = re.compile(r"\b(?:ddtree|gen_ai)_[a-z_]+")
ROWS = ("Traffic and latency", "Speculation", "Tree", "GPU")


def _dashboard() -> dict[str, Any]:
    dashboard: dict[str, Any] = json.loads((ROOT / "grafana-ddtree.json").read_text())
    return dashboard


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _queries() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in _panels() for target in panel["targets"]]


def test_grafana_queries_only_metrics_a_served_run_serves(run: Run) -> None:
    used = {name for _, expr in _queries() for name in NAME.findall(expr)}
    assert len(used) >= 25 and used <= set(run.served), sorted(used - set(run.served))


def test_grafana_groups_only_by_labels_the_metric_has(run: Run) -> None:
    grouped = 0
    for _, expr in _queries():
        for labels, inner in re.findall(r"by \(([^)]*)\)\s*\((.*?)\)\)", expr):
            (name,) = NAME.findall(inner)
            assert {x.strip() for x in labels.split(",")} <= run.served[name], expr
            grouped += 1
    assert grouped >= 12


def test_the_dashboard_asks_for_its_data_source_and_every_panel_uses_it() -> None:
    dashboard = _dashboard()
    (source,) = dashboard["__inputs"]
    assert (source["name"], source["type"], source["pluginId"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    assert {"type": "datasource", "id": "prometheus"}.items() <= dashboard["__requires"][1].items()
    assert {r["id"] for r in dashboard["__requires"]} >= {"grafana", "prometheus", "timeseries"}
    for panel in dashboard["panels"]:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert all(target["datasource"] == DATASOURCE for target in panel["targets"]), panel["title"]
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert [next(r for r in ROWS if title.startswith(r)) for title in rows] == list(ROWS)
    assert dashboard["panels"][0]["type"] == "row"  # every panel sits in a row


def test_titles_say_per_request_or_per_step() -> None:
    titles = [p["title"] for p in _panels()]
    assert "Acceptance length per request (tau): p50, p90 and mean" in titles
    assert "Accepted drafts per batched step" in titles
    for title in titles:
        if "acceptance length" in title.lower() or "percentile" in title or "p50" in title:
            assert "per request" in title or "per batched step" in title, title


@tools.PROMETHEUS
def test_every_panel_query_returns_data_from_a_served_run(run: Run) -> None:
    port = run.prometheus_port
    assert port is not None
    empty: list[str] = []

    def all_have_data() -> bool:  # every rate() needs two scrapes in its window after the counters moved
        empty[:] = [title for title, expr in _queries() if not query(port, expr)]
        return not empty

    assert wait_for(all_have_data), f"panels without data: {empty}"


def test_prometheus_config_scrapes_the_server_as_the_readme_starts_it() -> None:
    config = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "ddtree"
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{build_parser().parse_args(['serve']).port}"]
    text = (ROOT / "prometheus.yml").read_text()
    assert f"127.0.0.1:{TelemetryConfig.from_env({}).prometheus_port}" in text  # the commented telemetry job


@tools.PROMETHEUS
def test_prometheus_with_the_shipped_config_finds_the_server_up(run: Run, tmp_path: Path) -> None:
    text = (ROOT / "prometheus.yml").read_text()
    port = run.url.rsplit(":", 1)[1]
    assert text.count('"127.0.0.1:8000"') == 1
    with prometheus(text.replace('"127.0.0.1:8000"', f'"127.0.0.1:{port}"'), tmp_path / "shipped") as prom_port:
        targets: list[dict[str, Any]] = []

        def up() -> bool:
            try:
                reply = httpx.get(f"http://127.0.0.1:{prom_port}/api/v1/targets", timeout=5)
            except httpx.HTTPError:
                return False  # still starting
            if reply.status_code != 200:
                return False  # listening, not serving yet ("Service Unavailable")
            targets[:] = reply.json()["data"]["activeTargets"]
            return any(t["health"] == "up" for t in targets)

        assert wait_for(up), targets
    (target,) = targets
    assert target["labels"]["job"] == "ddtree" and target["scrapeUrl"] == f"http://127.0.0.1:{port}/metrics"
