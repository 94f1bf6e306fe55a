"""The exporter process's side: OTel providers, exporters, logger, NVML sampler and drop reports, from a config.

Imported only when telemetry is on. Exporters run on the SDK's worker threads, so an unreachable or slow
endpoint never blocks a decode step; failed exports are counted and logged once.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricExportResult,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult

from telemetry import semconv as sc
from telemetry.config import TelemetryConfig, TelemetryConfigError
from telemetry.logging import LogSink, make_logger, open_log_stream
from telemetry.metrics import MetricsSink
from telemetry.nvml import NvmlSampler
from telemetry.outbox import DropReport
from telemetry.stats import StatsSink
from telemetry.tracing import TraceSink


class ExportFailures:
    """Failed exports, by signal: counted (`semconv.METRIC_EXPORT_FAILURES`), and the first of each signal said
    once on stderr and in the log, with the endpoint and the cause. The SDK's exporters return only FAILURE and
    log the cause themselves; `_LastMessage` keeps that message, which becomes the cause here."""

    def __init__(self, log: Any, last: _LastMessage) -> None:
        self.log, self.last = log, last
        self.counter: Any = None  # made once the meter exists (`count_with`): the metric exporter comes first
        self.lock = threading.Lock()
        self.said: set[str] = set()

    def count_with(self, meter: Any) -> None:
        self.counter = meter.create_counter(sc.METRIC_EXPORT_FAILURES, description="failed exports, by signal")

    def failed(self, signal: str, endpoint: str, cause: str | None) -> None:
        if self.counter is not None:
            self.counter.add(1, {sc.LABEL_SIGNAL: signal})
        with self.lock:
            if signal in self.said:
                return
            self.said.add(signal)
        cause = cause or self.last.take() or "the exporter returned FAILURE without a cause"
        print(f"ddtree telemetry: {signal} export to {endpoint} failed: {cause} (said once; counted)", file=sys.stderr)
        fields = {sc.FIELD_EXPORT_SIGNAL: signal, sc.FIELD_EXPORT_ENDPOINT: endpoint, sc.FIELD_EXPORT_CAUSE: cause}
        self.log.warning(sc.EVENT_TELEMETRY, export="failed", note="logged once per signal", **fields)


class _LastMessage(logging.Handler):
    """The OTel exporters' warnings and errors since the last `take`, kept (not printed) to be a failed export's
    cause: the first (a retry's reason, such as the refused connection) and the last (why it gave up)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.first: str | None = None
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.first = self.first or message
        self.last = message

    def take(self) -> str | None:
        first, last = self.first, self.last
        self.first = self.last = None
        return first if first == last else f"{first}; then: {last}"


class CountingExporter(SpanExporter):
    """Wraps a span exporter: spans whose export failed are counted, and the first failure is reported."""

    def __init__(self, inner: SpanExporter, endpoint: str, failures: ExportFailures, counter: Any) -> None:
        self.inner, self.endpoint, self.failures, self.counter = inner, endpoint, failures, counter

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        cause = None
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # an exporter bug or a dead endpoint must not reach the decode loop
            result, cause = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        if result is not SpanExportResult.SUCCESS:
            self.counter.add(len(spans))
            self.failures.failed("traces", self.endpoint, cause)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


class CountingMetricExporter(MetricExporter):
    """Wraps a metric exporter: each failed export is counted and the first is reported."""

    def __init__(self, inner: MetricExporter, endpoint: str, failures: ExportFailures) -> None:
        super().__init__(inner._preferred_temporality, inner._preferred_aggregation)
        self.inner, self.endpoint, self.failures = inner, endpoint, failures

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        cause = None
        try:
            result = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as exc:  # as for spans: never past this point
            result, cause = MetricExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        if result is not MetricExportResult.SUCCESS:
            self.failures.failed("metrics", self.endpoint, cause)
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)


def otlp_endpoint(config: TelemetryConfig, path: str) -> str:
    """Where OTLP exports of `path` (`/v1/traces`, `/v1/metrics`) go, as the SDK resolves it."""
    if config.otlp_protocol == "grpc":
        return config.otlp_endpoint or "http://localhost:4317"
    return (config.otlp_endpoint or "http://localhost:4318").rstrip("/") + path


def _span_exporter(config: TelemetryConfig, failures: ExportFailures, dropped: Any) -> SpanExporter | None:
    inner = _otlp_span_exporter(config)
    if inner is None or config.traces_exporter == "console":
        return inner
    return CountingExporter(inner, otlp_endpoint(config, "/v1/traces"), failures, dropped)


def _otlp_module(config: TelemetryConfig, signal: str) -> Any:
    """The OTLP exporter module for `signal` (`trace_exporter`, `metric_exporter`) over the configured protocol;
    TelemetryConfigError naming the package where it is not installed."""
    import importlib

    protocol = "grpc" if config.otlp_protocol == "grpc" else "http"
    try:
        return importlib.import_module(f"opentelemetry.exporter.otlp.proto.{protocol}.{signal}")
    except ImportError as exc:
        package = f"opentelemetry-exporter-otlp-proto-{protocol}"
        raise TelemetryConfigError(
            f"OTLP over {config.otlp_protocol} needs the package {package}, which does not import here ({exc})"
        ) from None


def _otlp_span_exporter(config: TelemetryConfig) -> SpanExporter | None:
    if config.traces_exporter == "none":
        return None
    if config.traces_exporter == "console":
        return ConsoleSpanExporter(out=sys.stderr)
    module = _otlp_module(config, "trace_exporter")
    if config.otlp_protocol == "grpc":
        exporter: SpanExporter = module.OTLPSpanExporter(endpoint=config.otlp_endpoint, insecure=True, timeout=5)
        return exporter
    endpoint = config.otlp_endpoint.rstrip("/") + "/v1/traces" if config.otlp_endpoint else None
    exporter = module.OTLPSpanExporter(endpoint=endpoint, timeout=5)
    return exporter


def _metric_readers(
    config: TelemetryConfig, closers: list[Callable[[], None]], failures: ExportFailures
) -> tuple[list[MetricReader], int | None]:
    if config.metrics_exporter == "none":
        return [], None
    if config.metrics_exporter == "console":
        return [PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stderr))], None
    if config.metrics_exporter == "otlp":
        module = _otlp_module(config, "metric_exporter")
        if config.otlp_protocol == "grpc":
            exporter: Any = module.OTLPMetricExporter(endpoint=config.otlp_endpoint, insecure=True, timeout=5)
        else:
            endpoint = config.otlp_endpoint.rstrip("/") + "/v1/metrics" if config.otlp_endpoint else None
            exporter = module.OTLPMetricExporter(endpoint=endpoint, timeout=5)
        counted = CountingMetricExporter(exporter, otlp_endpoint(config, "/v1/metrics"), failures)
        return [PeriodicExportingMetricReader(counted, export_interval_millis=5000)], None
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(config.prometheus_port, addr=config.prometheus_host)
    except OSError as exc:
        where = f"{config.prometheus_host}:{config.prometheus_port}"
        raise TelemetryConfigError(f"cannot serve Prometheus metrics on {where}: {exc.strerror}") from exc
    closers.append(server.shutdown)
    # no `otel_scope_*` labels on every series and no `target_info` series: the scrape is the service's own
    return [PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False)], int(server.server_port)


@dataclass
class Sinks:
    """What the exporter process feeds: the sinks, what closes them, the Prometheus port if one is served, and
    where reports of dropped records go."""

    sinks: list[StatsSink]
    closers: list[Callable[[], None]]
    port: int | None
    report_drops: Callable[[DropReport], None]


def build_sinks(
    config: TelemetryConfig, device_type: str, model_name: str, detokenize: Callable[[list[int]], str] | None
) -> Sinks:
    """The sinks (spans, metrics, logs), NVML sampling and their exporters."""
    closers: list[Callable[[], None]] = []
    stream: IO[str] = open_log_stream(config)
    log = make_logger(config, stream)
    failures = ExportFailures(log, _keep_exporter_messages())
    resource = Resource.create({"service.name": config.service_name})
    readers, port = _metric_readers(config, closers, failures)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    meter = meter_provider.get_meter(sc.INSTRUMENTATION_SCOPE)
    failures.count_with(meter)
    sinks: list[StatsSink] = []
    span_exporter = _span_exporter(config, failures, meter.create_counter(sc.METRIC_DROPPED_SPANS))
    if span_exporter is not None:
        tracer_provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
        tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))  # sized by the OTEL_BSP_* variables
        closers.append(tracer_provider.shutdown)
        trace_sink = TraceSink(
            tracer_provider.get_tracer(sc.INSTRUMENTATION_SCOPE), model_name, config.log_content, detokenize
        )
        sinks.append(trace_sink)
    sinks.append(MetricsSink(meter))
    trace_ids = (lambda _s: trace_sink.last_trace_id) if span_exporter is not None else None
    sinks.append(LogSink(log, config.log_content, trace_ids, config.log_tree))
    if config.nvml_interval_ms > 0 and device_type == "cuda":
        sampler = NvmlSampler(meter, config.nvml_interval_ms, log)
        if sampler.start():
            closers.insert(0, sampler.stop)
    closers.append(meter_provider.shutdown)
    if stream.name not in ("<stderr>", "<stdout>"):
        closers.append(stream.close)
    return Sinks(sinks, closers, port, DropReporter(log).report)


def _keep_exporter_messages() -> _LastMessage:
    """The SDK's exporters log each failure (and each retry); those messages are kept as causes instead of
    printed, and `ExportFailures` says the first failure of each signal. The SDK's own errors stay visible."""
    last = _LastMessage()
    exporters = logging.getLogger("opentelemetry.exporter")
    exporters.addHandler(last)
    exporters.propagate = False
    exporters.setLevel(logging.WARNING)
    logging.getLogger("opentelemetry.sdk").setLevel(logging.ERROR)
    return last


class DropReporter:
    """Records the decode process dropped: a `ddtree.telemetry` line each report, which says how many and
    which. (They are counted where they are dropped, in the decode process: `Telemetry.dropped`, which the
    server serves on its `/metrics`; a counter here would lag behind a stalled sink.)"""

    def __init__(self, log: Any) -> None:
        self.log = log

    def report(self, report: DropReport) -> None:
        self.log.warning(
            sc.EVENT_TELEMETRY,
            **{
                sc.FIELD_DROPPED_STEPS: len(report.steps),
                sc.FIELD_DROPPED_STEP_IDS: report.steps,
                sc.FIELD_DROPPED_REQUESTS: len(report.requests),
                sc.FIELD_DROPPED_REQUEST_IDS: report.requests,
                sc.FIELD_DROPPED_TOTAL: sum(report.totals.values()),
            },
        )
