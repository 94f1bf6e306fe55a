from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from telemetry import semconv as sc

ROOT = Path(__file__).resolve().parents[2] / "dashboards"
UNIT_SUFFIX = {
    sc.UNIT_PERCENT: "_percent",
    sc.UNIT_BYTES: "_bytes",
    sc.UNIT_WATTS: "_watts",
    sc.UNIT_HERTZ: "_hertz",
    sc.UNIT_CELSIUS: "_celsius",
}


def served_names() -> set[str]:
    names = {getattr(sc, n) for n in dir(sc) if n.startswith("PROM_")}
    names |= {
        f"{n}{s}"
        for n in (sc.PROM_ACCEPTANCE_LENGTH, sc.PROM_TREE_NODES, sc.PROM_STAGE_DURATION_SECONDS)
        for s in ("_bucket", "_sum", "_count")
    }
    names.add(sc.METRIC_DROPPED_SPANS + "_total")
    gauges = {
        sc.METRIC_GPU_UTILIZATION: sc.UNIT_PERCENT,
        sc.METRIC_GPU_MEMORY_USED: sc.UNIT_BYTES,
        sc.METRIC_GPU_POWER: sc.UNIT_WATTS,
        sc.METRIC_GPU_SM_CLOCK: sc.UNIT_HERTZ,
        sc.METRIC_GPU_TEMPERATURE: sc.UNIT_CELSIUS,
    }
    names |= {name + UNIT_SUFFIX[unit] for name, unit in gauges.items()}
    return names


def test_grafana_queries_only_metrics_we_export() -> None:
    dashboard = json.loads((ROOT / "grafana-ddtree.json").read_text())
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\bddtree_[a-z_]+", target["expr"]))
    assert used and used <= served_names(), used - served_names()
    assert {sc.PROM_EMITTED_TOKENS_TOTAL, sc.PROM_ACCEPTED_PER_DEPTH_TOTAL} <= used


def test_prometheus_config_scrapes_the_default_port() -> None:
    config = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == ["127.0.0.1:9464"]
