"""Every exported field against an independent computation from what the engine itself produced.

The engine's outputs are each request's tokens and per-step acceptance lengths, and the trees it hands its
observer (copied here by a tee in front of the collector). From those alone, without telemetry's code, the
test recomputes every step's tree sizes, nodes and acceptances per depth (depths found by walking parent
pointers, not read from the tree's depth field), mean acceptance length and emitted tokens, and checks them
against the step logs, the span attributes and the metrics (counters by depth label and histogram buckets).
Stage times are positive, each at most its step's and together at most the step.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest

from ddtree.engine.engine import Engine, GenerationResult
from ddtree.methods import TreeShape
from ddtree.settings import GenerationConfig
from telemetry import semconv as sc
from tests.helpers import random_prompts, tiny_pair
from tests.telemetry.helpers import Captured, captured_telemetry

NEW_TOKENS = 15


class Tee:
    """Forwards every hook to `inner` and keeps a copy of each step's tree parents."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.parents: dict[int, list[list[int]]] = {}
        self.current = -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def on_step_start(self, step: int, batch_size: int, warmup: bool = False, shape: TreeShape | None = None) -> None:
        self.current = step
        self.inner.on_step_start(step, batch_size, warmup, shape)

    def on_tree(self, tree: Any) -> None:
        self.parents[self.current] = tree.parents.tolist()
        self.inner.on_tree(tree)


def walked_depth(parents: list[int], node: int) -> int:
    """Hops from `node` up to the root."""
    hops = 0
    while parents[node] >= 0:
        node, hops = parents[node], hops + 1
    return hops


@dataclass
class Expected:
    """One step as the engine's own output has it, for the requests that decoded in it."""

    accepted: list[int]
    emitted: list[int]
    tree_nodes: list[int]
    nodes_per_depth: list[int]  # depth 1 .. the deepest node of the step
    accepted_per_depth: list[int]
    rows: int  # slots the step ran: up to the last one still decoding, rounded up to a power of two


def expected_steps(tee: Tee, result: GenerationResult, ids: list[str], lines: list[dict[str, Any]]) -> list[Expected]:
    """For each step line (in step order), what it must say. Request i holds slot i; its j-th step line is
    its j-th acceptance length. (`rows` holds for steps run one at a time, not pipelined.)"""
    cursor = dict.fromkeys(ids, 0)
    kept = dict.fromkeys(ids, 1)  # the prefill's first token
    out = []
    for line in lines:
        accepted, emitted, nodes, depths = [], [], [], Counter[int]()
        decoding = [i for i, rid in enumerate(ids) if cursor[rid] < len(result.outputs[i].acceptance_lengths)]
        rows = min(len(ids), 1 << max(decoding).bit_length())
        for rid in line[sc.FIELD_REQUEST_IDS]:
            slot = ids.index(rid)
            length = result.outputs[slot].acceptance_lengths[cursor[rid]]
            cursor[rid] += 1
            accepted.append(length - 1)
            emitted.append(min(length, NEW_TOKENS - kept[rid]))
            kept[rid] += emitted[-1]
            parents = tee.parents[line[sc.FIELD_STEP]][slot]
            drafts = [i for i in range(1, len(parents)) if parents[i] >= 0]
            nodes.append(len(drafts))
            depths.update(walked_depth(parents, i) for i in drafts)
        deepest = max(depths, default=0)
        per_depth = [depths[d] for d in range(1, deepest + 1)]
        accepted_per_depth = [sum(a >= d for a in accepted) for d in range(1, deepest + 1)]
        out.append(Expected(accepted, emitted, nodes, per_depth, accepted_per_depth, rows))
    assert all(cursor[rid] == len(result.outputs[i].acceptance_lengths) for i, rid in enumerate(ids))
    return out


def _run(method: str, batch: int, depth: int, temperature: float) -> tuple[Captured, Tee, GenerationResult, list[str]]:
    target, drafter = tiny_pair(2, vocab=12, block_size=5)
    captured = captured_telemetry()
    tee = Tee(captured.collector)
    ids = [f"r{i}" for i in range(batch)]
    config = GenerationConfig(method=method, budget=16, temperature=temperature, seed=4, max_new_tokens=NEW_TOKENS)
    result = Engine(target, drafter, observer=tee, pipeline_depth=depth).generate(
        random_prompts(2, batch, vocab=12), config, request_ids=ids
    )
    return captured, tee, result, ids


CASES = [("ddtree", 3, 1, 0.0), ("ddtree", 3, 2, 0.0), ("ddtree", 2, 1, 0.7), ("dflash", 3, 1, 0.0), ("ar", 2, 2, 0.0)]


@dataclass
class Run:
    captured: Captured
    lines: list[dict[str, Any]]  # the step lines, in step order
    expected: list[Expected]  # one per step line
    result: GenerationResult
    pipelined: bool


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-batch{c[1]}-depth{c[2]}-T{c[3]}")
def run(request: pytest.FixtureRequest) -> Run:
    captured, tee, result, ids = _run(*request.param)
    lines = sorted((x for x in captured.log_lines() if x["event"] == sc.EVENT_STEP), key=lambda x: x[sc.FIELD_STEP])
    assert len(lines) == result.steps
    return Run(captured, lines, expected_steps(tee, result, ids, lines), result, request.param[2] > 1)


def test_step_logs(run: Run) -> None:
    lines, expected, result = run.lines, run.expected, run.result
    for line, want in zip(lines, expected, strict=True):
        assert line[sc.FIELD_ACCEPTED_DRAFTS] == want.accepted
        assert line[sc.FIELD_EMITTED] == want.emitted
        assert line[sc.FIELD_TREE_NODES] == want.tree_nodes
        assert line[sc.FIELD_NODES_PER_DEPTH] == want.nodes_per_depth
        assert line[sc.FIELD_ACCEPTED_PER_DEPTH] == want.accepted_per_depth
        # The rows the step ran (all joined at once and leave at the end of `generate`); the requests that
        # decoded in it, one per listed id and per tree.
        assert line[sc.FIELD_ROWS] == want.rows or run.pipelined
        assert len(want.accepted) <= line[sc.FIELD_ROWS] <= len(result.outputs)
        active = line[sc.FIELD_ACTIVE_REQUESTS]
        assert active == len(want.accepted) == len(line[sc.FIELD_REQUEST_IDS]) == len(line[sc.FIELD_TREE_NODES])
        assert line[sc.FIELD_WARMUP] is False, "no compilation or capture on this path"
    assert any(sum(w.accepted) for w in expected) or lines[0][sc.FIELD_METHOD] == "ar", "drafts were accepted"


def test_request_logs(run: Run) -> None:
    captured, result = run.captured, run.result
    requests = {x[sc.FIELD_REQUEST_ID]: x for x in captured.log_lines() if x["event"] == sc.EVENT_REQUEST}
    for i, output in enumerate(result.outputs):
        line = requests[f"r{i}"]
        lengths = output.acceptance_lengths
        assert line[sc.FIELD_STEPS] == len(lengths)
        assert line[sc.FIELD_OUTPUT_TOKENS] == len(output.token_ids) == NEW_TOKENS
        assert line[sc.FIELD_MEAN_ACCEPTANCE] == pytest.approx(sum(lengths) / len(lengths), abs=1e-4)


def _spans(captured: Captured) -> tuple[dict[int, Any], dict[int, list[Any]]]:
    """Step spans by step index; their stage spans by the step's span id."""
    spans = captured.spans.get_finished_spans()
    steps = {s.attributes[sc.ATTR_STEP_INDEX]: s for s in spans if s.name == sc.SPAN_STEP}
    stages: dict[int, list[Any]] = {}
    for s in spans:
        if s.name in {sc.stage_span_name(x) for x in sc.STAGES}:
            stages.setdefault(s.parent.span_id, []).append(s)
    return steps, stages


def test_span_attributes(run: Run) -> None:
    captured, lines, expected = run.captured, run.lines, run.expected
    steps, _ = _spans(captured)
    assert len(steps) == len(lines)
    for line, want in zip(lines, expected, strict=True):
        attributes = steps[line[sc.FIELD_STEP]].attributes
        assert attributes[sc.ATTR_TREE_NODES] == sum(want.tree_nodes)
        assert attributes[sc.ATTR_TREE_DEPTH] == len(want.nodes_per_depth)
        assert attributes[sc.ATTR_ACCEPTED_TOKENS] == sum(want.accepted)
        mean = sum(a + 1 for a in want.accepted) / len(want.accepted)
        assert attributes[sc.ATTR_MEAN_ACCEPTANCE] == pytest.approx(mean)
        assert attributes[sc.ATTR_BATCH_SIZE] == line[sc.FIELD_ACTIVE_REQUESTS]
        assert attributes[sc.ATTR_ROWS] == line[sc.FIELD_ROWS]


def test_stage_times_fit_in_their_step(run: Run) -> None:
    captured, lines = run.captured, run.lines
    steps, stages = _spans(captured)
    for line in lines:
        step = steps[line[sc.FIELD_STEP]]
        children = stages[step.context.span_id]
        assert sorted(c.name for c in children) == sorted(sc.stage_span_name(x) for x in sc.STAGES)
        whole = step.end_time - step.start_time
        durations = [c.end_time - c.start_time for c in children]
        assert all(0 < d <= whole for d in durations), (durations, whole)
        assert sum(durations) <= whole
        assert all(step.start_time <= c.start_time and c.end_time <= step.end_time for c in children)
        by_name = {c.name: (c.end_time - c.start_time) / 1e6 for c in children}
        logged = line[sc.FIELD_STAGE_MS]
        assert {sc.stage_span_name(s): ms for s, ms in logged.items()} == pytest.approx(by_name, abs=1e-4)


def _bucket_counts(values: list[float], bounds: tuple[float, ...]) -> list[int]:
    """Counts per explicit bucket as OTel defines them: bucket i holds bounds[i-1] < v <= bounds[i]."""
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1
    return counts


def test_metrics(run: Run) -> None:
    captured, lines, expected, result = run.captured, run.lines, run.expected, run.result
    points = captured.metric_points()

    def by_depth(name: str) -> dict[int, int]:
        return {int(p.attributes[sc.LABEL_DEPTH]): p.value for p in points.get(name, []) if p.value}

    nodes, accepted = Counter[int](), Counter[int]()
    for want in expected:
        nodes.update({d + 1: n for d, n in enumerate(want.nodes_per_depth) if n})
        accepted.update({d + 1: n for d, n in enumerate(want.accepted_per_depth) if n})
    assert by_depth(sc.METRIC_TREE_NODES_PER_DEPTH) == dict(nodes)
    assert by_depth(sc.METRIC_ACCEPTED_PER_DEPTH) == dict(accepted)
    assert captured.counter(sc.METRIC_DRAFT_TOKENS) == sum(sum(w.tree_nodes) for w in expected)
    assert captured.counter(sc.METRIC_STEPS) == result.steps
    lengths = [float(a + 1) for w in expected for a in w.accepted]
    sizes = [float(n) for w in expected for n in w.tree_nodes]
    for name, values in ((sc.METRIC_ACCEPTANCE_LENGTH, lengths), (sc.METRIC_TREE_NODES, sizes)):
        (point,) = points[name]
        assert point.count == len(values) and point.sum == sum(values)
        assert list(point.bucket_counts) == _bucket_counts(values, tuple(point.explicit_bounds)), name
    _, stages = _spans(captured)
    for point in points[sc.METRIC_STAGE_DURATION]:
        stage = sc.stage_span_name(point.attributes[sc.LABEL_STAGE])
        seconds = [(c.end_time - c.start_time) / 1e9 for cs in stages.values() for c in cs if c.name == stage]
        assert point.count == len(lines) == len(seconds)
        assert point.sum == pytest.approx(sum(seconds), rel=1e-9)
        assert list(point.bucket_counts) == _bucket_counts(seconds, tuple(point.explicit_bounds))


def test_the_walk_is_independent_of_the_depth_field() -> None:
    """The helper itself: depths from parent pointers agree with a hand-made tree."""
    parents = [-1, 0, 0, 1, 3, -1]  # root, two children, a grandchild, a great-grandchild, padding
    assert [walked_depth(parents, i) for i in range(5)] == [0, 1, 1, 2, 3]
