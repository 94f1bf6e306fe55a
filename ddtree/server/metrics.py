"""The server's Prometheus metrics, in a registry of each app's own, and the ASGI middleware that counts.

- `ddtree_http_requests_total{endpoint, status}` and `ddtree_http_request_duration_seconds{endpoint}`: every
  HTTP request, counted when its response ends (a stream: when its last chunk is sent or the client goes);
  paths other than the server's routes are counted as endpoint `other`.
- `gen_ai_server_time_to_first_token_seconds{endpoint}`: from the handler's start to the prefill's first token.
- `gen_ai_server_time_per_output_token_seconds{endpoint}`: per request of two or more tokens, the time after the
  first token over the tokens after it (OTel GenAI's `gen_ai.server.time_per_output_token`).
- `ddtree_generated_tokens_total{endpoint}`: the completion tokens of each response (`usage`), stop strings
  and disconnects included up to where the response ended.
- `ddtree_waiting_requests`, `ddtree_running_requests`: gauges read from the decode thread at scrape time.
- `ddtree_telemetry_dropped_records_total{kind}`: telemetry records (kind `step`, or `request` for a request's
  start or end) that a slow or stalled sink made telemetry drop, counted where they are dropped, in this process;
  0 while telemetry keeps every record, absent when telemetry is off.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from telemetry import semconv as sc

TELEMETRY_SCRAPE_TIMEOUT_S = 1.0  # the telemetry exporter answers on loopback in milliseconds
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
OTHER = "other"


class _Dropped(Collector):
    """The telemetry's drop counts, read at scrape time (`dropped()`: kind -> records since start)."""

    def __init__(self, dropped: Callable[[], dict[str, int]]) -> None:
        self.dropped = dropped

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self.dropped()
        if not counts:
            return
        family = CounterMetricFamily(
            sc.PROM_DROPPED_RECORDS_TOTAL.removesuffix("_total"),
            "Telemetry records dropped because a sink could not keep up, by kind",
            labels=[sc.LABEL_KIND],
        )
        for kind, count in sorted(counts.items()):
            family.add_metric([kind], count)
        yield family


class ServerMetrics:
    def __init__(
        self, waiting: Callable[[], int], running: Callable[[], int], dropped: Callable[[], dict[str, int]] = dict
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Dropped(dropped))
        self.requests = Counter(
            sc.PROM_HTTP_REQUESTS_TOTAL,
            "HTTP requests by endpoint and status",
            [sc.LABEL_ENDPOINT, sc.LABEL_STATUS],
            registry=self.registry,
        )
        self.duration = Histogram(
            sc.PROM_HTTP_REQUEST_DURATION_SECONDS,
            "HTTP request latency, to the end of the response (streams included)",
            [sc.LABEL_ENDPOINT],
            buckets=sc.HTTP_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.first_token = Histogram(
            sc.PROM_TIME_TO_FIRST_TOKEN_SECONDS,
            "Time from a request's arrival to its first generated token",
            [sc.LABEL_ENDPOINT],
            buckets=sc.TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.per_token = Histogram(
            sc.PROM_TIME_PER_OUTPUT_TOKEN_SECONDS,
            "Time per output token after the first: (end - first token) / (tokens - 1), per request",
            [sc.LABEL_ENDPOINT],
            buckets=sc.TIME_PER_OUTPUT_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.generated = Counter(
            sc.PROM_GENERATED_TOKENS_TOTAL, "Completion tokens returned", [sc.LABEL_ENDPOINT], registry=self.registry
        )
        Gauge(sc.PROM_WAITING_REQUESTS, "Requests waiting for a slot", registry=self.registry).set_function(waiting)
        Gauge(sc.PROM_RUNNING_REQUESTS, "Requests in the decode session", registry=self.registry).set_function(running)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def request_done(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.duration.labels(endpoint).observe(seconds)


def endpoint_label(path: str) -> str:
    return path if path in ENDPOINTS else OTHER


class MetricsMiddleware:
    """Counts every HTTP request with the status it was answered with, when its response ends."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception before any response

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.request_done(endpoint_label(str(scope["path"])), status, time.perf_counter() - started)


async def telemetry_exposition(telemetry: Any) -> bytes:
    """The telemetry layer's Prometheus text (`DDTREE_DEBUG_METRICS=1`), fetched from its exporter process on
    loopback, so that `/metrics` is the one endpoint; empty when telemetry is off or does not answer (a
    telemetry failure never fails the scrape of the server's own metrics)."""
    port = getattr(telemetry, "prometheus_port", None)
    if not port:
        return b""
    return await asyncio.to_thread(_fetch, f"http://127.0.0.1:{port}/metrics")


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=TELEMETRY_SCRAPE_TIMEOUT_S) as response:
            body: bytes = response.read()
            return body
    except OSError:
        return b""
