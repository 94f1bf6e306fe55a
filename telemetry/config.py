"""Telemetry settings from the environment. Parsing imports nothing from OpenTelemetry.

| variable | values | default |
|---|---|---|
| DDTREE_DEBUG_METRICS | 0, 1, true, false | 0 (off) |
| OTEL_SERVICE_NAME | any | ddtree |
| OTEL_TRACES_EXPORTER | otlp, console, none | otlp |
| OTEL_METRICS_EXPORTER | otlp, prometheus, console, none | prometheus |
| OTEL_EXPORTER_OTLP_ENDPOINT | URL | http://127.0.0.1:4317 (grpc), http://127.0.0.1:4318 (http) |
| OTEL_EXPORTER_OTLP_PROTOCOL | grpc, http/protobuf | grpc |
| OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG | the OTel SDK's samplers | parentbased_always_on |
| DDTREE_PROMETHEUS_HOST, DDTREE_PROMETHEUS_PORT | address to serve /metrics on | 127.0.0.1, 9464 |
| DDTREE_LOG_FILE | path; `-` is stdout | stderr |
| DDTREE_LOG_FORMAT | json, console | json |
| DDTREE_NVML_INTERVAL_MS | milliseconds; 0 turns NVML sampling off | 500 |
| DDTREE_LOG_CONTENT | 0, 1, true, false: put prompt and completion text in logs and spans | 0 |
| DDTREE_LOG_TREE | 0..1: the share of steps whose step line carries every node's rank and probability | 0 |
| DDTREE_TELEMETRY_BUFFER_MB | records waiting for a slow sink, at most (then steps are dropped, counted) | 256 |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

TRUE, FALSE = ("1", "true"), ("0", "false", "")


class TelemetryConfigError(ValueError):
    """A telemetry variable has a value we do not accept."""


@dataclass(frozen=True)
class TelemetryConfig:
    enabled: bool = False
    service_name: str = "ddtree"
    traces_exporter: str = "otlp"
    metrics_exporter: str = "prometheus"
    otlp_endpoint: str | None = None
    otlp_protocol: str = "grpc"
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int = 9464
    log_file: str | None = None  # None: stderr; "-": stdout
    log_format: str = "json"
    nvml_interval_ms: int = 500
    log_content: bool = False
    log_tree: float = 0.0  # share of steps logged with per-node ranks and log-probabilities (top-k replay)
    buffer_mb: int = 256  # records queued for the exporter process at most, in MiB (`telemetry.outbox`)

    @property
    def buffer_bytes(self) -> int:
        return self.buffer_mb << 20

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TelemetryConfig:
        e = os.environ if env is None else env
        return cls(
            enabled=_flag(e, "DDTREE_DEBUG_METRICS"),
            service_name=e.get("OTEL_SERVICE_NAME") or "ddtree",
            traces_exporter=_choice(e, "OTEL_TRACES_EXPORTER", ("otlp", "console", "none"), "otlp"),
            metrics_exporter=_choice(
                e, "OTEL_METRICS_EXPORTER", ("otlp", "prometheus", "console", "none"), "prometheus"
            ),
            otlp_endpoint=e.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
            otlp_protocol=_choice(e, "OTEL_EXPORTER_OTLP_PROTOCOL", ("grpc", "http/protobuf"), "grpc"),
            prometheus_host=e.get("DDTREE_PROMETHEUS_HOST") or "127.0.0.1",
            prometheus_port=_int(e, "DDTREE_PROMETHEUS_PORT", 9464, 0, 65535),
            log_file=e.get("DDTREE_LOG_FILE") or None,
            log_format=_choice(e, "DDTREE_LOG_FORMAT", ("json", "console"), "json"),
            nvml_interval_ms=_int(e, "DDTREE_NVML_INTERVAL_MS", 500, 0, 3_600_000),
            log_content=_flag(e, "DDTREE_LOG_CONTENT"),
            log_tree=_share(e, "DDTREE_LOG_TREE"),
            buffer_mb=_int(e, "DDTREE_TELEMETRY_BUFFER_MB", 256, 1, 1 << 20),
        )


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise TelemetryConfigError(f"{name} must be 0, 1, true or false, got {env[name]!r}")


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = env.get(name, "").strip().lower() or default
    if value not in allowed:
        raise TelemetryConfigError(f"{name} must be one of {', '.join(allowed)}, got {env[name]!r}")
    return value


def _int(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise TelemetryConfigError(f"{name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise TelemetryConfigError(f"{name} must be in {low}..{high}, got {value}")
    return value


def _share(env: Mapping[str, str], name: str) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise TelemetryConfigError(f"{name} must be a number in 0..1, got {raw!r}") from None
    if not 0.0 <= value <= 1.0:
        raise TelemetryConfigError(f"{name} must be in 0..1, got {value}")
    return value
