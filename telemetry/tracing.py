"""Spans emitted after the fact, with explicit start and end times taken from the stage clocks.

A request span (`ddtree.request`, with `gen_ai.*` attributes) is open while its batch decodes. A step
span (`ddtree.step`) has one child per stage. When one request runs alone its request span parents the
step spans; when a batch runs, each step span links to the request spans of the batch, and each request
span to the step spans that served it.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, format_trace_id
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ddtree.methods import mean_acceptance_length
from ddtree.observer import GenerateInfo, RequestResult
from telemetry import semconv as sc
from telemetry.stats import StepStats

_PROPAGATOR = TraceContextTextMapPropagator()  # W3C trace context: a client's `traceparent` header


class TraceSink:
    def __init__(self, tracer: Any, model_name: str = "", log_content: bool = False, detokenize: Any = None) -> None:
        self.tracer = tracer
        self.model_name = model_name
        self.log_content = log_content
        self.detokenize = detokenize
        self.requests: dict[str, Any] = {}
        self.last_trace_id: str | None = None

    def start_requests(self, info: GenerateInfo) -> None:
        parents = info.trace_parents or [None] * len(info.request_ids)
        for rid, prompt, parent in zip(info.request_ids, info.prompt_tokens, parents, strict=True):
            attributes: dict[str, Any] = {
                sc.GEN_AI_OPERATION_NAME: sc.GEN_AI_OPERATION_TEXT_COMPLETION,
                sc.GEN_AI_SYSTEM: sc.GEN_AI_SYSTEM_DDTREE,
                sc.GEN_AI_REQUEST_MODEL: self.model_name,
                sc.GEN_AI_REQUEST_MAX_TOKENS: info.max_new_tokens,
                sc.GEN_AI_REQUEST_TEMPERATURE: info.temperature,
                sc.GEN_AI_REQUEST_SEED: info.seed,
                sc.GEN_AI_USAGE_INPUT_TOKENS: len(prompt),
                sc.ATTR_REQUEST_ID: rid,
                sc.ATTR_METHOD: info.method,
            }
            if self.log_content and self.detokenize is not None:
                attributes[sc.GEN_AI_PROMPT] = self.detokenize(prompt)
            context = _PROPAGATOR.extract({"traceparent": parent}) if parent else None
            self.requests[rid] = self.tracer.start_span(sc.SPAN_REQUEST, context=context, attributes=attributes)

    def step(self, stats: StepStats) -> None:
        spans = [self.requests[r] for r in stats.request_ids if r in self.requests]
        alone = stats.active_requests == 1 and len(spans) == 1
        context = trace.set_span_in_context(spans[0]) if alone else None
        links = None if alone else [Link(s.get_span_context()) for s in spans]
        lengths = [n + 1 for n in stats.accepted]
        step_span = self.tracer.start_span(
            sc.SPAN_STEP,
            context=context,
            links=links,
            start_time=stats.start_ns,
            attributes={  # an unset top-k is no attribute (null in logs and responses: absent everywhere)
                sc.ATTR_STEP_INDEX: stats.step,
                sc.ATTR_METHOD: stats.info.method,
                sc.ATTR_BATCH_SIZE: stats.active_requests,
                sc.ATTR_ROWS: stats.row_count,
                sc.ATTR_WARMUP: stats.warmup,
                sc.ATTR_BUDGET: stats.info.budget,
                sc.ATTR_TREE_NODES: sum(stats.tree_nodes),
                sc.ATTR_TREE_DEPTH: stats.tree_depth,
                sc.ATTR_ACCEPTED_TOKENS: sum(stats.accepted),
                sc.ATTR_MEAN_ACCEPTANCE: mean_acceptance_length(lengths) or 0.0,
            }
            | ({} if stats.info.topk is None else {sc.ATTR_TOPK: stats.info.topk})
            | ({} if stats.gain is None else {sc.ATTR_PREDICTED_GAIN: stats.gain}),
        )
        if links:  # and each request links to the steps that served it (the SDK keeps up to 128 links a span)
            for span in spans:
                span.add_link(step_span.get_span_context())
        if step_span.is_recording():  # a step the sampler left out costs no stage spans either
            parent = trace.set_span_in_context(step_span)
            for stage, (start, end) in stats.stage_ns.items():
                self.tracer.start_span(sc.stage_span_name(stage), context=parent, start_time=start).end(end_time=end)
        step_span.end(end_time=stats.end_ns)
        self.last_trace_id = format_trace_id(step_span.get_span_context().trace_id)

    def end_requests(self, info: GenerateInfo, results: list[RequestResult]) -> None:
        for result in results:
            span = self.requests.pop(result.request_id, None)
            if span is None:
                continue
            span.set_attribute(sc.GEN_AI_USAGE_OUTPUT_TOKENS, len(result.output_tokens))
            span.set_attribute(sc.GEN_AI_RESPONSE_FINISH_REASONS, [result.finish_reason])
            if self.log_content and self.detokenize is not None:
                span.set_attribute(sc.GEN_AI_COMPLETION, self.detokenize(result.output_tokens))
            span.end()
