"""Step statistics as OTel metrics. Counters are cumulative; PromQL takes the rates, e.g.

rate(ddtree_accepted_tokens_total[1m]) / rate(ddtree_steps_total[1m])      accepted drafts per step
rate(ddtree_emitted_tokens_total[1m])                                       tokens per second
histogram_quantile(0.9, rate(ddtree_stage_duration_seconds_bucket[5m]))     p90 stage time, by stage
sum by (depth) (rate(ddtree_accepted_tokens_per_depth_total[5m]))
  / sum by (depth) (rate(ddtree_tree_nodes_per_depth_total[5m]))           acceptance per tree node, by depth
"""

from __future__ import annotations

from typing import Any

from telemetry import semconv as sc
from telemetry.collector import StepStats
from telemetry.hooks import GenerateInfo, RequestResult


class MetricsSink:
    def __init__(self, meter: Any) -> None:
        self.steps = meter.create_counter(sc.METRIC_STEPS, description="decode steps (one verify forward each)")
        self.draft_tokens = meter.create_counter(sc.METRIC_DRAFT_TOKENS, description="draft tree nodes verified")
        self.accepted = meter.create_counter(sc.METRIC_ACCEPTED_TOKENS, description="accepted drafts, bonus excluded")
        self.emitted = meter.create_counter(sc.METRIC_EMITTED_TOKENS, description="tokens returned to requests")
        self.accepted_depth = meter.create_counter(sc.METRIC_ACCEPTED_PER_DEPTH, description="accepted drafts by depth")
        self.nodes_depth = meter.create_counter(sc.METRIC_TREE_NODES_PER_DEPTH, description="tree nodes by depth")
        self.acceptance_length = meter.create_histogram(
            sc.METRIC_ACCEPTANCE_LENGTH,
            description="per request and step: accepted drafts + 1",
            explicit_bucket_boundaries_advisory=sc.ACCEPTANCE_LENGTH_BUCKETS,
        )
        self.tree_nodes = meter.create_histogram(
            sc.METRIC_TREE_NODES,
            description="draft nodes per request and step",
            explicit_bucket_boundaries_advisory=sc.TREE_NODES_BUCKETS,
        )
        self.stage_duration = meter.create_histogram(
            sc.METRIC_STAGE_DURATION,
            unit=sc.UNIT_SECONDS,
            description="time per stage of a decode step",
            explicit_bucket_boundaries_advisory=sc.STAGE_DURATION_BUCKETS,
        )

    def start_requests(self, info: GenerateInfo) -> None:
        pass

    def step(self, stats: StepStats) -> None:
        labels = {sc.LABEL_METHOD: stats.info.method}
        self.steps.add(1, labels)
        self.draft_tokens.add(sum(stats.tree_nodes), labels)
        self.accepted.add(sum(stats.accepted), labels)
        self.emitted.add(sum(stats.emitted), labels)
        for depth in range(1, stats.tree_depth + 1):
            self.nodes_depth.add(stats.nodes_per_depth[depth], {**labels, sc.LABEL_DEPTH: str(depth)})
            self.accepted_depth.add(stats.accepted_per_depth[depth], {**labels, sc.LABEL_DEPTH: str(depth)})
        for n, nodes in zip(stats.accepted, stats.tree_nodes, strict=True):
            self.acceptance_length.record(n + 1, labels)
            self.tree_nodes.record(nodes, labels)
        for stage, (start, end) in stats.stage_ns.items():
            self.stage_duration.record((end - start) / 1e9, {**labels, sc.LABEL_STAGE: stage})

    def end_requests(self, info: GenerateInfo, results: list[RequestResult]) -> None:
        # The first token of each request comes from prefill, outside any step.
        self.emitted.add(sum(1 for r in results if r.output_tokens), {sc.LABEL_METHOD: info.method})
