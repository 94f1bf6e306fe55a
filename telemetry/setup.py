"""Build the OTel providers, exporters, logger, NVML sampler and collector from a `TelemetryConfig`.

Imported only when telemetry is on. Exporters run on the SDK's worker threads, so an unreachable or slow
endpoint never blocks a decode step; failed exports are counted and logged once.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult

from telemetry import semconv as sc
from telemetry.collector import Collector
from telemetry.config import TelemetryConfig, TelemetryConfigError
from telemetry.logging import LogSink, make_logger, open_log_stream
from telemetry.metrics import MetricsSink
from telemetry.nvml import NvmlSampler
from telemetry.stats import StatsSink
from telemetry.tracing import TraceSink


class CountingExporter(SpanExporter):
    """Wraps an exporter: spans whose export failed are counted, and the first failure is logged."""

    def __init__(self, inner: SpanExporter, log: Any, counter: Any) -> None:
        self.inner, self.log, self.counter = inner, log, counter
        self.dropped = 0
        self.lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # an exporter bug or a dead endpoint must not reach the decode loop
            result, reason = SpanExportResult.FAILURE, str(exc)
        else:
            reason = "export failed"
        if result is not SpanExportResult.SUCCESS:
            with self.lock:
                first = self.dropped == 0
                self.dropped += len(spans)
            self.counter.add(len(spans))
            if first:
                self.log.warning(sc.EVENT_TELEMETRY, spans="dropped", reason=reason, note="logged once")
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


@dataclass
class Telemetry:
    """What `start_telemetry` returns: the observer to hand the engine, and how to stop it all."""

    observer: Any
    prometheus_port: int | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    def shutdown(self, timeout_s: float = 3.0) -> None:
        """Flush and stop exporters, bounded in time: a dead endpoint cannot hang the exit."""
        worker = threading.Thread(target=self._close_all, daemon=True)
        worker.start()
        worker.join(timeout_s)

    def _close_all(self) -> None:
        for close in self.closers:
            with contextlib.suppress(Exception):  # shutting down: nothing left to protect but the exit
                close()


def _span_exporter(config: TelemetryConfig) -> SpanExporter | None:
    if config.traces_exporter == "none":
        return None
    if config.traces_exporter == "console":
        return ConsoleSpanExporter(out=sys.stderr)
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=config.otlp_endpoint, insecure=True, timeout=5)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    endpoint = config.otlp_endpoint.rstrip("/") + "/v1/traces" if config.otlp_endpoint else None
    return HttpExporter(endpoint=endpoint, timeout=5)


def _metric_readers(
    config: TelemetryConfig, closers: list[Callable[[], None]]
) -> tuple[list[MetricReader], int | None]:
    if config.metrics_exporter == "none":
        return [], None
    if config.metrics_exporter == "console":
        return [PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stderr))], None
    if config.metrics_exporter == "otlp":
        if config.otlp_protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics

            exporter: Any = GrpcMetrics(endpoint=config.otlp_endpoint, insecure=True, timeout=5)
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics

            endpoint = config.otlp_endpoint.rstrip("/") + "/v1/metrics" if config.otlp_endpoint else None
            exporter = HttpMetrics(endpoint=endpoint, timeout=5)
        return [PeriodicExportingMetricReader(exporter, export_interval_millis=5000)], None
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(config.prometheus_port, addr=config.prometheus_host)
    except OSError as exc:
        where = f"{config.prometheus_host}:{config.prometheus_port}"
        raise TelemetryConfigError(f"cannot serve Prometheus metrics on {where}: {exc.strerror}") from exc
    closers.append(server.shutdown)
    return [PrometheusMetricReader()], int(server.server_port)


def build(
    config: TelemetryConfig, device_type: str, model_name: str, detokenize: Callable[[list[int]], str] | None
) -> Telemetry:
    """The collector in this process; its sinks in an exporter process (`telemetry.process`)."""
    from telemetry.process import ExporterProcess

    exporter = ExporterProcess(config, device_type, model_name, detokenize)
    # On CUDA the decode thread waits for the device every step: the collector's work runs in that wait.
    collector = Collector([exporter], device_type, tree_detail=config.log_tree > 0, handoff=device_type == "cuda")
    return Telemetry(
        observer=collector, prometheus_port=exporter.prometheus_port, closers=[collector.close, exporter.close]
    )


def build_sinks(
    config: TelemetryConfig, device_type: str, model_name: str, detokenize: Callable[[list[int]], str] | None
) -> tuple[list[StatsSink], list[Callable[[], None]], int | None]:
    """The sinks (spans, metrics, logs), NVML sampling and their exporters; what closes them; the port of
    the Prometheus endpoint, if one is served."""
    closers: list[Callable[[], None]] = []
    stream: IO[str] = open_log_stream(config)
    # Exporter failures are counted and logged once by CountingExporter, not once per retry by the SDK.
    logging.getLogger("opentelemetry.exporter").setLevel(logging.CRITICAL)
    logging.getLogger("opentelemetry.sdk").setLevel(logging.ERROR)
    log = make_logger(config, stream)
    resource = Resource.create({"service.name": config.service_name})
    readers, port = _metric_readers(config, closers)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    meter = meter_provider.get_meter(sc.INSTRUMENTATION_SCOPE)
    sinks: list[StatsSink] = []
    inner = _span_exporter(config)
    if inner is not None:
        tracer_provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
        exporter = CountingExporter(inner, log, meter.create_counter(sc.METRIC_DROPPED_SPANS))
        tracer_provider.add_span_processor(BatchSpanProcessor(exporter))  # sized by the OTEL_BSP_* variables
        closers.append(tracer_provider.shutdown)
        trace_sink = TraceSink(
            tracer_provider.get_tracer(sc.INSTRUMENTATION_SCOPE), model_name, config.log_content, detokenize
        )
        sinks.append(trace_sink)
    sinks.append(MetricsSink(meter))
    trace_ids = (lambda _s: trace_sink.last_trace_id) if inner is not None else None
    sinks.append(LogSink(log, config.log_content, trace_ids, config.log_tree))
    if config.nvml_interval_ms > 0 and device_type == "cuda":
        sampler = NvmlSampler(meter, config.nvml_interval_ms, log)
        if sampler.start():
            closers.insert(0, sampler.stop)
    closers.append(meter_provider.shutdown)
    if stream.name not in ("<stderr>", "<stdout>"):
        closers.append(stream.close)
    return sinks, closers, port
