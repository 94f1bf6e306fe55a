from __future__ import annotations

import pytest

from telemetry.config import TelemetryConfig, TelemetryConfigError


def test_defaults_are_off_and_local() -> None:
    config = TelemetryConfig.from_env({})
    assert not config.enabled and not config.log_content
    assert config.prometheus_host == "127.0.0.1"
    assert (config.traces_exporter, config.metrics_exporter, config.otlp_protocol) == ("otlp", "prometheus", "grpc")


@pytest.mark.parametrize(
    ("value", "enabled"), [("1", True), ("true", True), ("TRUE", True), ("0", False), ("false", False)]
)
def test_debug_metrics_flag(value: str, enabled: bool) -> None:
    assert TelemetryConfig.from_env({"DDTREE_DEBUG_METRICS": value}).enabled is enabled


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DDTREE_DEBUG_METRICS", "yes"),
        ("OTEL_TRACES_EXPORTER", "jaeger"),
        ("OTEL_METRICS_EXPORTER", "statsd"),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("DDTREE_LOG_FORMAT", "xml"),
        ("DDTREE_NVML_INTERVAL_MS", "fast"),
        ("DDTREE_PROMETHEUS_PORT", "70000"),
        ("DDTREE_LOG_CONTENT", "maybe"),
    ],
)
def test_bad_values_are_clear_errors(name: str, value: str) -> None:
    with pytest.raises(TelemetryConfigError, match=name):
        TelemetryConfig.from_env({name: value})


def test_all_variables_are_read() -> None:
    config = TelemetryConfig.from_env(
        {
            "DDTREE_DEBUG_METRICS": "1",
            "OTEL_SERVICE_NAME": "svc",
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "DDTREE_LOG_FILE": "-",
            "DDTREE_LOG_FORMAT": "console",
            "DDTREE_NVML_INTERVAL_MS": "0",
            "DDTREE_LOG_CONTENT": "1",
        }
    )
    assert config == TelemetryConfig(
        enabled=True,
        service_name="svc",
        traces_exporter="console",
        metrics_exporter="otlp",
        otlp_endpoint="http://127.0.0.1:9",
        otlp_protocol="http/protobuf",
        log_file="-",
        log_format="console",
        nvml_interval_ms=0,
        log_content=True,
    )
