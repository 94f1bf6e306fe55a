"""Step statistics as OTel metrics. Counters are cumulative; PromQL takes the rates, e.g.

rate(ddtree_accepted_tokens_total[1m]) / rate(ddtree_steps_total[1m])      accepted drafts per step
rate(ddtree_emitted_tokens_total[1m])                                       tokens per second
histogram_quantile(0.9, rate(ddtree_stage_duration_seconds_bucket[5m]))     p90 stage time, by stage
sum by (depth) (rate(ddtree_accepted_tokens_per_depth_total[5m]))
  / sum by (depth) (rate(ddtree_tree_nodes_per_depth_total[5m]))           acceptance per tree node, by depth

The tree against its chain (`telemetry.chain`; steps whose accepted ranks reached the collector, every step of
a decode session):
sum by (depth) (rate(ddtree_off_chain_accepted_tokens_per_depth_total[5m]))  accepted drafts not the top-1
sum(rate(ddtree_tree_added_tokens_per_depth_total[5m]))
  / sum(rate(ddtree_acceptance_length_count[5m]))                            tau(tree) - tau(its chain prefix)
sum by (depth) (rate(ddtree_off_chain_parent_accepted_tokens_per_depth_total[5m]))
  / sum by (depth) (rate(ddtree_off_chain_parent_nodes_per_depth_total[5m])) acceptance of a node whose
                                                                             parent is off the chain
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

from ddtree.observer import GenerateInfo, RequestResult
from telemetry import semconv as sc
from telemetry.chain import count_at
from telemetry.stats import StepStats

Labels = tuple[tuple[str, str], ...]

COUNTERS = (
    (sc.METRIC_STEPS, "decode steps (one verify forward each)"),
    (sc.METRIC_DRAFT_TOKENS, "draft tree nodes verified"),
    (sc.METRIC_ACCEPTED_TOKENS, "accepted drafts, bonus excluded"),
    (sc.METRIC_EMITTED_TOKENS, "tokens returned to requests"),
    (sc.METRIC_ACCEPTED_PER_DEPTH, "accepted drafts by depth"),
    (sc.METRIC_TREE_NODES_PER_DEPTH, "tree nodes by depth"),
    (sc.METRIC_OFF_CHAIN_ACCEPTED_PER_DEPTH, "accepted drafts that were not the drafter's top-1 at their depth"),
    (sc.METRIC_TREE_ADDED_PER_DEPTH, "accepted drafts below where the path left the chain, by depth"),
    (sc.METRIC_OFF_CHAIN_PARENT_ACCEPTED_PER_DEPTH, "accepted drafts whose parent is off the chain, by depth"),
    (sc.METRIC_OFF_CHAIN_PARENT_NODES_PER_DEPTH, "tree nodes whose parent is off the chain, by depth"),
    (sc.METRIC_PREDICTED_STEPS, "request steps whose tree carried the drafter's prediction"),
    (sc.METRIC_PREDICTED_ACCEPTED, "accepted drafts the drafter's probabilities predicted (sum over request steps)"),
    (sc.METRIC_PREDICTION_ERROR, "|predicted - accepted drafts| summed over request steps"),
)
CHAIN_COUNTERS = (  # counter -> the `ChainCounts` list it adds
    (sc.METRIC_OFF_CHAIN_ACCEPTED_PER_DEPTH, "off_chain"),
    (sc.METRIC_TREE_ADDED_PER_DEPTH, "tree_added"),
    (sc.METRIC_OFF_CHAIN_PARENT_ACCEPTED_PER_DEPTH, "off_parent"),
    (sc.METRIC_OFF_CHAIN_PARENT_NODES_PER_DEPTH, "off_parent_nodes"),
)


class MetricsSink:
    """Counters are observable: a step adds to plain totals, and the SDK reads them when it collects (at a
    scrape or an export), so a step costs a few dict updates instead of an SDK call per label."""

    def __init__(self, meter: Any) -> None:
        self.totals: dict[str, defaultdict[Labels, float]] = {name: defaultdict(float) for name, _ in COUNTERS}
        for name, description in COUNTERS:
            meter.create_observable_counter(name, callbacks=[self._observe(name)], description=description)
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

    def _observe(self, name: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        totals = self.totals[name]

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            items = list(totals.items())  # one C-level copy: safe against the step updates on another thread
            return [Observation(value, dict(labels)) for labels, value in items]

        return observe

    def start_requests(self, info: GenerateInfo) -> None:
        pass

    def step(self, stats: StepStats) -> None:
        method = ((sc.LABEL_METHOD, stats.info.method),)
        totals = self.totals
        totals[sc.METRIC_STEPS][method] += 1
        totals[sc.METRIC_DRAFT_TOKENS][method] += sum(stats.tree_nodes)
        totals[sc.METRIC_ACCEPTED_TOKENS][method] += sum(stats.accepted)
        totals[sc.METRIC_EMITTED_TOKENS][method] += sum(stats.emitted)
        for depth in range(1, stats.tree_depth + 1):
            labels = (*method, (sc.LABEL_DEPTH, str(depth)))
            totals[sc.METRIC_TREE_NODES_PER_DEPTH][labels] += stats.nodes_per_depth[depth]
            totals[sc.METRIC_ACCEPTED_PER_DEPTH][labels] += stats.accepted_per_depth[depth]
        predicted = stats.predicted
        if predicted is not None and stats.predicted_widths:
            at_run = [row[-1] for row in predicted]
            totals[sc.METRIC_PREDICTED_STEPS][method] += len(at_run)
            totals[sc.METRIC_PREDICTED_ACCEPTED][method] += sum(at_run)
            error = sum(abs(p - a) for p, a in zip(at_run, stats.accepted, strict=True))
            totals[sc.METRIC_PREDICTION_ERROR][method] += error
        chain = stats.chain
        if chain is not None:
            for depth in range(1, chain.depth + 1):
                labels = (*method, (sc.LABEL_DEPTH, str(depth)))
                for name, values in CHAIN_COUNTERS:
                    totals[name][labels] += count_at(getattr(chain, values), depth)
        attributes = dict(method)
        for n, nodes in zip(stats.accepted, stats.tree_nodes, strict=True):
            self.acceptance_length.record(n + 1, attributes)
            self.tree_nodes.record(nodes, attributes)
        if stats.warmup:
            return  # compilation and capture are not what a stage costs
        for stage, (start, end) in stats.stage_ns.items():
            self.stage_duration.record((end - start) / 1e9, {**attributes, sc.LABEL_STAGE: stage})

    def end_requests(self, info: GenerateInfo, results: list[RequestResult]) -> None:
        # The first token of each request comes from prefill, outside any step.
        self.totals[sc.METRIC_EMITTED_TOKENS][((sc.LABEL_METHOD, info.method),)] += sum(
            1 for r in results if r.output_tokens
        )
