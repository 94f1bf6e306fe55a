"""In-process telemetry with injected providers: in-memory spans and metrics, logs to a string."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from telemetry.collector import Collector
from telemetry.config import TelemetryConfig
from telemetry.logging import LogSink, make_logger
from telemetry.metrics import MetricsSink
from telemetry.tracing import TraceSink


@dataclass
class Captured:
    collector: Collector
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader
    log: io.StringIO

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.getvalue().splitlines() if line.strip()]

    def metric_points(self) -> dict[str, list[Any]]:
        data = self.metrics.get_metrics_data()
        out: dict[str, list[Any]] = {}
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    out.setdefault(metric.name, []).extend(metric.data.data_points)
        return out

    def counter(self, name: str) -> float:
        return sum(p.value for p in self.metric_points().get(name, []))


def captured_telemetry(log_content: bool = False, sampler: Any = None, handoff: bool = False) -> Captured:
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider(sampler=sampler)
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    log = io.StringIO()
    logger = make_logger(TelemetryConfig(), log)
    trace_sink = TraceSink(tracer_provider.get_tracer("test"), "tiny", log_content, lambda ids: ",".join(map(str, ids)))
    sinks = [trace_sink, MetricsSink(meter), LogSink(logger, log_content, lambda _s: trace_sink.last_trace_id)]
    return Captured(Collector(sinks, "cpu", handoff=handoff), spans, reader, log)
