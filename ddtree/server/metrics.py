"""The server's Prometheus metrics, in a registry of each app's own, and the ASGI middleware that counts.

Every name is in `telemetry.semconv`; docs/serving.md lists them with their vLLM and OTel counterparts.

HTTP, by endpoint (the server's routes; other paths are `other`), counted when a response ends (a stream: when
its last chunk is sent or the client goes):
- `ddtree_http_requests_total{endpoint, status}`, `ddtree_http_request_duration_seconds{endpoint}`.

Per generation request, labelled with OTel GenAI's attributes (`gen_ai_operation_name` "text_completion" or
"chat", `gen_ai_request_model`, `gen_ai_provider_name` "ddtree"); TTFT and TPOT keep `endpoint` too:
- `gen_ai_server_request_duration_seconds`: from the handler's start to the response's end.
- `gen_ai_server_time_to_first_token_seconds`: from the handler's start to the prefill's first token.
- `gen_ai_server_time_per_output_token_seconds`: per request of two or more tokens, the time after the first
  token over the tokens after it.
- `ddtree_request_queue_time_seconds`: from `submit` to the decode thread taking the request into a slot.
- `ddtree_request_prefill_time_seconds`: from taking it into a slot to handing over its first token (the
  prefill, and in a pipelined session the step whose readback carries that token). TTFT less queue and prefill
  time is the API process's and the transport's share.
- `ddtree_prompt_tokens_total` (at the first token: the prompt was prefilled), `ddtree_generation_tokens_total`
  (as tokens arrive; the response's `usage` once it ends), `ddtree_request_success_total{finished_reason}`
  (stop, length, abort: the client went away or the job was cancelled, error: the generation failed).
- `ddtree_generated_tokens_total{endpoint}`: the completion tokens of each response, counted at its end (the
  older name; `ddtree_generation_tokens_total` counts the same tokens by the GenAI labels).

Speculative decoding, by `method` and `model_name`, from the acceptance lengths and budgets the decode thread
hands each request (host data it has anyway: no device sync, no flag). A draft is one request's tree in one
step; counted as the request takes its update, so they reconcile with the responses' `ddtree` blocks:
- `ddtree_spec_decode_drafts_total{budget}`: request steps, by the step's budget (0: an `ar` step).
- `ddtree_spec_decode_draft_tokens_total`: draft nodes verified (each step's budget).
- `ddtree_spec_decode_accepted_tokens_total`: drafts accepted (the bonus token excluded).
- `ddtree_spec_decode_accepted_tokens_per_pos_total{position}`: drafts accepted at depth 1, 2, ...
- `ddtree_spec_decode_request_acceptance_length`: histogram of each request's mean acceptance length (tau)
  when it ends, over its steps (requests of no step are not observed).

PromQL: `1 + rate(accepted[5m]) / rate(drafts[5m])` is tau per request step, `rate(accepted[5m]) /
rate(draft_tokens[5m])` the share of verified drafts accepted, `sum by (position) (rate(per_pos[5m])) / on()
group_left() sum(rate(drafts[5m]))` the acceptance rate at each depth.

Server state, read at scrape time: `ddtree_waiting_requests`, `ddtree_running_requests`, `ddtree_slots`;
`ddtree_telemetry_dropped_records_total{kind}`: telemetry records (kind `step`, or `request` for a request's
start or end) that a slow or stalled sink made telemetry drop, in this process; absent when telemetry is off.

No `_created` series: the exposition leaves them out (prometheus-client's `disable_created_metrics()` would
do it for every registry of the process).
"""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from telemetry import semconv as sc
from telemetry.tally import SpecTally

TELEMETRY_SCRAPE_TIMEOUT_S = 1.0  # the telemetry exporter answers on loopback in milliseconds
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
OTHER = "other"
OPERATIONS = (sc.GEN_AI_OPERATION_TEXT_COMPLETION, sc.GEN_AI_OPERATION_CHAT)


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


class _EngineState(Collector):
    """The engine's state, read at scrape time (in an API process: as the engine's last message said)."""

    def __init__(self, gauges: list[tuple[str, str, Callable[[], int]]]) -> None:
        self.gauges = gauges

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, documentation, read in self.gauges:
            yield GaugeMetricFamily(name, documentation, value=read())


class _WithoutCreated(Collector):
    """A registry's families without their `_created` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():  # fresh objects each collect
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class Speculation:
    """The speculative-decoding counters of one served model and method."""

    def __init__(self, registry: CollectorRegistry, model: str, method: str) -> None:
        labels = [sc.LABEL_METHOD, sc.LABEL_MODEL]
        self.key = (method, model)
        self._children: dict[tuple[int, int], Counter] = {}
        self.drafts = Counter(
            sc.PROM_SPEC_DRAFTS_TOTAL,
            "Drafts verified: one per request per decode step, by the step's budget (0: an ar step)",
            [*labels, sc.LABEL_BUDGET],
            registry=registry,
        )
        self.draft_tokens = Counter(
            sc.PROM_SPEC_DRAFT_TOKENS_TOTAL, "Draft tokens verified (tree nodes)", labels, registry=registry
        ).labels(*self.key)
        self.accepted = Counter(
            sc.PROM_SPEC_ACCEPTED_TOKENS_TOTAL, "Draft tokens accepted (bonus excluded)", labels, registry=registry
        ).labels(*self.key)
        self.per_position = Counter(
            sc.PROM_SPEC_ACCEPTED_PER_POS_TOTAL,
            "Draft tokens accepted at each depth of the tree (1: the root's children)",
            [*labels, sc.LABEL_POSITION],
            registry=registry,
        )
        self.request_length = Histogram(
            sc.PROM_SPEC_REQUEST_ACCEPTANCE_LENGTH,
            "Per request, when it ends: the mean of its steps' acceptance lengths (accepted drafts + 1), tau",
            labels,
            buckets=sc.REQUEST_ACCEPTANCE_LENGTH_BUCKETS,
            registry=registry,
        ).labels(*self.key)

    def add(self, tally: SpecTally) -> None:
        """Request steps tallied since the last call."""
        for budget, count in tally.drafts.items():
            self._child(self.drafts, budget).inc(count)
        self.draft_tokens.inc(tally.draft_tokens)
        self.accepted.inc(tally.accepted)
        for position, reached in enumerate(tally.per_depth, start=1):
            self._child(self.per_position, position).inc(reached)

    def _child(self, family: Counter, value: int) -> Counter:
        """`family`'s counter for this model and method and `value` (a budget or a position), looked up once."""
        key = (id(family), value)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*self.key, str(value))
        return child

    def request_done(self, lengths: list[int]) -> None:
        if lengths:
            self.request_length.observe(sum(lengths) / len(lengths))


class ServerMetrics:
    def __init__(
        self,
        waiting: Callable[[], int],
        running: Callable[[], int],
        dropped: Callable[[], dict[str, int]] = dict,
        slots: Callable[[], int] = lambda: 0,
        model: str = "",
        method: str = "",
        multiprocess_dir: str | None = None,
    ) -> None:
        """`multiprocess_dir`: this process is one of several API processes in prometheus-client's
        multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, set before any of them started): a scrape of any of them
        sums every process's counters and histograms, the ones that have ended included."""
        self.registry = CollectorRegistry()
        self.model = model
        self._tally = SpecTally()  # what updates took since the last flush (`took`)
        self._tokens: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._flush_due = False
        self._http()
        self._requests()
        self.speculation = Speculation(self.registry, model, method)
        self.exposed = CollectorRegistry()  # what a scrape reads: the counters (this process's or all) and state
        if multiprocess_dir is None:
            self.exposed.register(_WithoutCreated(self.registry))
        else:
            MultiProcessCollector(self.exposed, path=multiprocess_dir)  # type: ignore[no-untyped-call]
        self.exposed.register(_Dropped(dropped))
        gauges = [
            (sc.PROM_WAITING_REQUESTS, "Requests waiting for a slot", waiting),
            (sc.PROM_RUNNING_REQUESTS, "Requests in the decode session", running),
            (sc.PROM_SLOTS, "Slots of the decode session", slots),
        ]
        self.exposed.register(_EngineState(gauges))

    def _http(self) -> None:
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

    def _requests(self) -> None:
        gen_ai, timed = list(sc.GEN_AI_LABELS), [sc.LABEL_ENDPOINT, *sc.GEN_AI_LABELS]
        registry = self.registry
        self.request_duration = Histogram(
            sc.PROM_REQUEST_DURATION_SECONDS,
            "Generation request duration, from the handler's start to the response's end",
            gen_ai,
            buckets=sc.REQUEST_DURATION_BUCKETS,
            registry=registry,
        )
        self.first_token = Histogram(
            sc.PROM_TIME_TO_FIRST_TOKEN_SECONDS,
            "Time from a request's arrival to its first generated token",
            timed,
            buckets=sc.TIME_TO_FIRST_TOKEN_BUCKETS,
            registry=registry,
        )
        self.per_token = Histogram(
            sc.PROM_TIME_PER_OUTPUT_TOKEN_SECONDS,
            "Time per output token after the first: (end - first token) / (tokens - 1), per request",
            timed,
            buckets=sc.TIME_PER_OUTPUT_TOKEN_BUCKETS,
            registry=registry,
        )
        self.queue_time = Histogram(
            sc.PROM_REQUEST_QUEUE_TIME_SECONDS,
            "Time a request waited for a slot, from its submission to joining the decode session",
            gen_ai,
            buckets=sc.QUEUE_TIME_BUCKETS,
            registry=registry,
        )
        self.prefill_time = Histogram(
            sc.PROM_REQUEST_PREFILL_TIME_SECONDS,
            "Time from joining the decode session to handing over the first token (the prefill and its readback)",
            gen_ai,
            buckets=sc.QUEUE_TIME_BUCKETS,
            registry=registry,
        )
        self.generated = Counter(
            sc.PROM_GENERATED_TOKENS_TOTAL, "Completion tokens returned", [sc.LABEL_ENDPOINT], registry=registry
        )
        self.prompt_tokens = Counter(sc.PROM_PROMPT_TOKENS_TOTAL, "Prompt tokens prefilled", gen_ai, registry=registry)
        self.generation_tokens = Counter(
            sc.PROM_GENERATION_TOKENS_TOTAL, "Completion tokens generated", gen_ai, registry=registry
        )
        self.success = Counter(
            sc.PROM_REQUEST_SUCCESS_TOTAL,
            "Generation requests ended, by finish reason (abort: cancelled or the client went away; error: failed)",
            [*gen_ai, sc.LABEL_FINISHED_REASON],
            registry=registry,
        )
        for operation in OPERATIONS:  # zeros from the start: rate() sees the first request, panels show 0
            labels = self.gen_ai_labels(operation)
            self.prompt_tokens.labels(*labels)
            self.generation_tokens.labels(*labels)
            for reason in sc.FINISHED_REASONS:
                self.success.labels(*labels, reason)

    def gen_ai_labels(self, operation: str) -> tuple[str, str, str]:
        """The values of `semconv.GEN_AI_LABELS` for a request of this operation."""
        return operation, self.model, sc.GEN_AI_SYSTEM_DDTREE

    def exposition(self) -> tuple[bytes, str]:
        self.flush()
        return generate_latest(self.exposed), CONTENT_TYPE_LATEST

    def took(self, labels: tuple[str, str, str], tokens: int, lengths: list[int], budgets: list[int]) -> None:
        """An update's tokens and steps, counted once per turn of the event loop for all the updates of that
        turn (a counter's increment in multiprocess mode writes a file), before any scrape reads them; at
        once where there is no running loop."""
        self._tokens[labels] += tokens
        if lengths:
            self._tally.add([n - 1 for n in lengths], budgets)
        if self._flush_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        self._flush_due = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Count what `took` gathered."""
        self._flush_due = False
        tokens, self._tokens = self._tokens, collections.Counter()
        for labels, count in tokens.items():
            if count:
                self.generation_tokens.labels(*labels).inc(count)
        if self._tally:
            tally, self._tally = self._tally, SpecTally()
            self.speculation.add(tally)

    def request_done(self, endpoint: str, status: int, seconds: float) -> None:
        self.requests.labels(endpoint, str(status)).inc()
        self.duration.labels(endpoint).observe(seconds)

    def meter(self, endpoint: str, chat: bool, arrived: float) -> RequestMeter:
        return RequestMeter(self, endpoint, chat, arrived)


class RequestMeter:
    """One generation request's metrics, called on the event loop: its first token, each update it takes (tokens
    and steps) and its end. `arrived`, and every time given, is `time.perf_counter()`'s."""

    def __init__(self, metrics: ServerMetrics, endpoint: str, chat: bool, arrived: float) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.chat = chat
        self.labels = metrics.gen_ai_labels(sc.GEN_AI_OPERATION_CHAT if chat else sc.GEN_AI_OPERATION_TEXT_COMPLETION)
        self.arrived = arrived
        self.first_token_at: float | None = None
        self.ended = False

    def first_token(self, prompt_tokens: int) -> None:
        """The prefill's token reached the handler."""
        self.first_token_at = now = time.perf_counter()
        self.metrics.first_token.labels(self.endpoint, *self.labels).observe(now - self.arrived)
        self.metrics.prompt_tokens.labels(*self.labels).inc(prompt_tokens)

    def took(self, tokens: int, lengths: list[int], budgets: list[int]) -> None:
        """An update: `tokens` more completion tokens, and its steps' acceptance lengths and budgets."""
        self.metrics.took(self.labels, tokens, lengths, budgets)

    def end(
        self,
        finished_reason: str,
        tokens: int,
        lengths: list[int],
        queued: tuple[float | None, float | None, float | None],
    ) -> None:
        """The response ended (once; later calls do nothing): `tokens` completion tokens in all, every step's
        acceptance length, and (queued_at, joined_at, first_at) of its job where it was queued, joined and
        handed its first token."""
        if self.ended:
            return
        self.ended = True
        metrics, labels, now = self.metrics, self.labels, time.perf_counter()
        metrics.generated.labels(self.endpoint).inc(tokens)
        metrics.success.labels(*labels, finished_reason).inc()
        metrics.request_duration.labels(*labels).observe(now - self.arrived)
        metrics.speculation.request_done(lengths)
        queued_at, joined_at, first_at = queued
        if queued_at is not None and joined_at is not None:
            metrics.queue_time.labels(*labels).observe(max(joined_at - queued_at, 0.0))
        if joined_at is not None and first_at is not None:
            metrics.prefill_time.labels(*labels).observe(max(first_at - joined_at, 0.0))
        if tokens > 1 and self.first_token_at is not None:
            per_token = (now - self.first_token_at) / (tokens - 1)
            metrics.per_token.labels(self.endpoint, *labels).observe(per_token)


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


async def telemetry_exposition(port: int | None) -> bytes:
    """The telemetry layer's Prometheus text (`DDTREE_DEBUG_METRICS=1`), fetched from its exporter process on
    loopback (`port`, None when telemetry is off), so that `/metrics` is the one endpoint; empty when telemetry
    is off or does not answer (a telemetry failure never fails the scrape of the server's own metrics)."""
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
