from __future__ import annotations

from typing import Any

import pandas as pd
import pytest

from ddtree.engine.engine import Engine
from ddtree.settings import GenerationConfig
from telemetry import semconv as sc
from tests.helpers import random_prompts, shape_of, tiny_pair
from tests.telemetry.helpers import captured_telemetry


@pytest.mark.parametrize(
    ("method", "batch", "depth", "handoff"),
    [
        ("ddtree", 3, 1, False),
        ("dflash", 1, 1, False),
        ("ar", 2, 1, False),
        ("ddtree", 3, 2, False),
        ("ddtree", 3, 2, True),
        ("dflash", 2, 1, True),
    ],
)
def test_metrics_logs_and_spans_reconcile_with_the_output(method: str, batch: int, depth: int, handoff: bool) -> None:
    """Depth 2: each step is launched before the last one's tokens are read, as on a GPU with graphs. With
    `handoff` the sinks are called from the collector's thread, and have everything once it is flushed."""
    target, drafter = tiny_pair(2, vocab=12, block_size=5)
    captured = captured_telemetry(handoff=handoff)
    prompts = random_prompts(2, batch, vocab=12)
    result = Engine(target, drafter, observer=captured.collector, pipeline_depth=depth).generate(
        prompts, GenerationConfig(method=method, budget=16, max_new_tokens=15)
    )
    assert captured.collector.flush(timeout_s=30)
    captured.collector.close()
    tokens = sum(len(o.token_ids) for o in result.outputs)
    accepted = sum(a - 1 for o in result.outputs for a in o.acceptance_lengths)

    assert captured.counter(sc.METRIC_EMITTED_TOKENS) == tokens
    assert captured.counter(sc.METRIC_STEPS) == result.steps
    assert captured.counter(sc.METRIC_ACCEPTED_TOKENS) == accepted
    per_depth = captured.metric_points().get(sc.METRIC_ACCEPTED_PER_DEPTH, [])
    assert sum(p.value for p in per_depth) == accepted
    lengths = captured.metric_points()[sc.METRIC_ACCEPTANCE_LENGTH]
    assert sum(p.sum for p in lengths) == sum(a for o in result.outputs for a in o.acceptance_lengths)

    lines = pd.read_json(__import__("io").StringIO(captured.log.getvalue()), lines=True)
    steps = lines[lines["event"] == sc.EVENT_STEP]
    requests = lines[lines["event"] == sc.EVENT_REQUEST]
    assert len(steps) == result.steps and len(requests) == batch
    assert sum(sum(e) for e in steps[sc.FIELD_EMITTED]) + batch == tokens
    assert sorted(requests[sc.FIELD_OUTPUT_TOKENS]) == sorted(len(o.token_ids) for o in result.outputs)
    assert sc.FIELD_PROMPT_TOKEN_IDS not in requests.columns, "no content without DDTREE_LOG_CONTENT"
    if method == "ar":
        assert all(n == [0] * len(n) for n in steps["tree_nodes"])
        assert sc.FIELD_PREDICTED_ACCEPTED not in steps.columns and not captured.counter(sc.METRIC_PREDICTED_STEPS)
    else:
        assert sum(sum(n) for n in steps["tree_nodes"]) == captured.counter(sc.METRIC_DRAFT_TOKENS) > 0
        _check_predictions(steps, captured)

    spans = captured.spans.get_finished_spans()
    by_name: dict[str, list[Any]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert len(by_name[sc.SPAN_STEP]) == result.steps and len(by_name[sc.SPAN_REQUEST]) == batch
    step_ids = {s.context.span_id for s in by_name[sc.SPAN_STEP]}
    for stage in sc.STAGES:
        children = by_name[sc.stage_span_name(stage)]
        assert len(children) == result.steps and {c.parent.span_id for c in children} == step_ids
    request_ids = {s.context.span_id for s in by_name[sc.SPAN_REQUEST]}
    for step in by_name[sc.SPAN_STEP]:
        if step.parent is not None:  # the step ran one request (its rows held one): its span is the parent
            assert step.parent.span_id in request_ids and not step.links
        else:
            linked = {link.context.span_id for link in step.links}  # the requests that decoded in this step
            assert batch > 1 and linked and linked <= request_ids
            for request in by_name[sc.SPAN_REQUEST]:  # and the requests link back to the steps that served them
                back = {link.context.span_id for link in request.links}
                assert (step.context.span_id in back) == (request.context.span_id in linked)
        assert step.attributes[sc.ATTR_METHOD] == method
        assert step.start_time <= step.end_time
    usage = sorted(s.attributes[sc.GEN_AI_USAGE_OUTPUT_TOKENS] for s in by_name[sc.SPAN_REQUEST])
    assert usage == sorted(len(o.token_ids) for o in result.outputs)
    assert set(steps["trace_id"]) <= {format(s.context.trace_id, "032x") for s in by_name[sc.SPAN_STEP]}


def _check_predictions(steps: Any, captured: Any) -> None:
    """Each row's prediction: one per request step, within its tree's nodes, growing with the width, the
    widest being the tree run; the metrics' sums are the log's."""
    predicted = [p for row in steps[sc.FIELD_PREDICTED_ACCEPTED] for p in row]
    accepted = [a for row in steps[sc.FIELD_ACCEPTED_DRAFTS] for a in row]
    nodes = [n for row in steps["tree_nodes"] for n in row]
    assert len(predicted) == len(accepted) == captured.counter(sc.METRIC_PREDICTED_STEPS)
    assert all(0 < p <= n for p, n in zip(predicted, nodes, strict=True))
    lines = zip(
        steps[sc.FIELD_PREDICTED_WIDTHS],
        steps[sc.FIELD_PREDICTED_AT_WIDTHS],
        steps[sc.FIELD_PREDICTED_ACCEPTED],
        strict=True,
    )
    for widths, curves, run in lines:
        assert widths == sorted(widths) and widths[-1] == max(widths)
        for curve, at_run in zip(curves, run, strict=True):
            assert curve == sorted(curve) and curve[-1] == at_run
    slack = 1e-4 * len(predicted)  # the log rounds to 4 places
    assert captured.counter(sc.METRIC_PREDICTED_ACCEPTED) == pytest.approx(sum(predicted), abs=slack)
    error = sum(abs(p - a) for p, a in zip(predicted, accepted, strict=True))
    assert captured.counter(sc.METRIC_PREDICTION_ERROR) == pytest.approx(error, abs=slack)


def test_content_is_logged_only_when_asked() -> None:
    target, drafter = tiny_pair(0, vocab=16)
    captured = captured_telemetry(log_content=True)
    Engine(target, drafter, observer=captured.collector).generate([[1, 2, 3]], GenerationConfig(max_new_tokens=4))
    request = next(line for line in captured.log_lines() if line["event"] == sc.EVENT_REQUEST)
    assert request[sc.FIELD_PROMPT_TOKEN_IDS] == [1, 2, 3]
    span = next(s for s in captured.spans.get_finished_spans() if s.name == sc.SPAN_REQUEST)
    assert span.attributes[sc.GEN_AI_PROMPT] == "1,2,3"


def test_a_failing_sink_is_dropped_and_decoding_goes_on() -> None:
    class Broken:
        def start_requests(self, info: Any) -> None:
            pass

        def step(self, stats: Any) -> None:
            raise RuntimeError("sink bug")

        def end_requests(self, info: Any, results: Any) -> None:
            pass

    target, drafter = tiny_pair(0, vocab=16)
    captured = captured_telemetry()
    captured.collector.sinks.insert(0, Broken())
    plain = Engine(target, drafter).generate([[1, 2]], GenerationConfig(max_new_tokens=8))
    with pytest.warns(UserWarning, match="Broken failed and is off"):
        out = Engine(target, drafter, observer=captured.collector).generate(
            [[1, 2]], GenerationConfig(max_new_tokens=8)
        )
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert captured.counter(sc.METRIC_EMITTED_TOKENS) == 8, "the other sinks keep working"


def test_steps_the_sampler_leaves_out_get_no_stage_spans() -> None:
    """Stage spans follow their step span: a sampler that drops step spans (and would keep anything else)
    leaves no stage spans either, and the step logs go on."""
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class DropSteps(Sampler):
        def should_sample(self, parent_context: Any, trace_id: int, name: str, *args: Any, **kwargs: Any) -> Any:
            return SamplingResult(Decision.DROP if name == sc.SPAN_STEP else Decision.RECORD_AND_SAMPLE)

        def get_description(self) -> str:
            return "DropSteps"

    target, drafter = tiny_pair(0, vocab=16)
    captured = captured_telemetry(sampler=DropSteps())
    result = Engine(target, drafter, observer=captured.collector).generate(
        [[1, 2], [3]], GenerationConfig(max_new_tokens=6)
    )
    names = {s.name for s in captured.spans.get_finished_spans()}
    assert names == {sc.SPAN_REQUEST}
    steps = [line for line in captured.log_lines() if line["event"] == sc.EVENT_STEP]
    assert len(steps) == result.steps > 0


class _Steps:
    """A sink that keeps the records it is handed."""

    def __init__(self) -> None:
        self.steps: list[Any] = []  # StepStats

    def start_requests(self, info: Any) -> None:
        pass

    def step(self, stats: Any) -> None:
        self.steps.append(stats)

    def end_requests(self, info: Any, results: Any) -> None:
        pass


@pytest.mark.parametrize("with_verify", [True, False])
def test_records_reach_the_sinks_in_groups_and_all_by_the_end(with_verify: bool) -> None:
    """Records are handed on a group at a time while decoding (after a verify stage, or when too many wait
    without one), in step order, and every one by the end of `generate`."""
    from ddtree.observer import GenerateInfo
    from telemetry.collector import DRAIN_EVERY, MAX_PENDING, Collector

    sink = _Steps()
    collector = Collector([sink])
    collector.on_generate_start(GenerateInfo("ddtree", 4, None, 0.0, 8, 0, ["r"], [[1]]))
    stages = [sc.STAGE_DRAFT, sc.STAGE_VERIFY] if with_verify else [sc.STAGE_DRAFT]
    group = DRAIN_EVERY if with_verify else MAX_PENDING
    seen = []
    for step in range(2 * group + 3):
        collector.on_step_start(step, 1)
        for stage in stages:
            collector.on_stage_start(stage)
            collector.on_stage_end(stage)
        collector.on_accept(step, None, [1])  # type: ignore[arg-type]
        collector.on_step_end(step, [2])
        seen.append(len(sink.steps))
    assert max(seen) >= group, "records waited for the end of generate"
    assert all(n == 0 or n >= group - 1 for n in seen), "records were handed on one at a time"
    collector.on_generate_end([])
    assert [s.step for s in sink.steps] == list(range(2 * group + 3))


def test_requests_that_join_and_leave_a_session_are_logged_by_slot() -> None:
    """Continuous batching: each step's log lists the requests that decoded in it, whatever slot they hold,
    and each request's line and span come when it leaves, with the trace parent its client sent."""
    from ddtree.engine.requests import Request
    from ddtree.engine.session import DecodeSession

    target, drafter = tiny_pair(4, vocab=16, block_size=4)
    captured = captured_telemetry()
    session = DecodeSession(
        target, drafter, shape_of("ddtree", 8, None, drafter), slots=2, capacity=96, observer=captured.collector
    )
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    plan = [Request([1, 2, 3], 6, request_id="a", trace_parent=parent), Request([4], 14, request_id="b")]
    plan.append(Request([5, 6], 5, request_id="c"))  # joins slot 0 once "a" has left
    slot_of, outputs = {}, {}
    while plan or slot_of:
        if plan and session.free_slots():
            request = plan.pop(0)
            slot_of[request.request_id] = session.join([request])[0]
        session.step()
        for rid, slot in list(slot_of.items()):
            if session.output(slot).finished:
                outputs[rid] = session.leave(slot).token_ids
                del slot_of[rid]
    lines = captured.log_lines()
    steps = [line for line in lines if line["event"] == sc.EVENT_STEP]
    requests = {line[sc.FIELD_REQUEST_ID]: line for line in lines if line["event"] == sc.EVENT_REQUEST}
    assert {rid: r[sc.FIELD_OUTPUT_TOKENS] for rid, r in requests.items()} == {k: len(v) for k, v in outputs.items()}
    for rid, tokens in outputs.items():  # every token after the prefill's first one came in a step that lists rid
        emitted = sum(
            e for s in steps for r, e in zip(s[sc.FIELD_REQUEST_IDS], s[sc.FIELD_EMITTED], strict=True) if r == rid
        )
        assert emitted + 1 == len(tokens), rid
    assert any(set(s[sc.FIELD_REQUEST_IDS]) == {"b", "c"} for s in steps), "c decoded beside b in a's old slot"
    spans = {
        s.attributes.get(sc.ATTR_REQUEST_ID): s
        for s in captured.spans.get_finished_spans()
        if s.name == sc.SPAN_REQUEST
    }
    assert format(spans["a"].context.trace_id, "032x") == parent.split("-")[1]
    assert spans["a"].parent is not None and format(spans["a"].parent.span_id, "016x") == parent.split("-")[2]
    assert spans["b"].parent is None


def test_assign_slots_names_each_rows_request_for_the_next_step() -> None:
    """A server whose batch rows move (SGLang): after `assign_slots`, row i of the step is that request."""
    from ddtree.observer import GenerateInfo
    from telemetry.collector import Collector

    sink = _Steps()
    collector = Collector([sink])
    for rid, slot in (("a", 0), ("b", 1), ("c", 2)):
        collector.on_generate_start(GenerateInfo("ddtree", 8, None, 0.0, 8, 0, [rid], [[1, 2]], slots=[slot]))
    collector.assign_slots(["c", "a"])  # "b" left the batch; "c" moved to row 0
    collector.on_step_start(0, 2)
    collector.on_accept(0, None, [2, 0])  # type: ignore[arg-type]  # the result itself is not read
    collector.on_step_end(0, [3, 1])
    collector._drain(wait=True)
    assert sink.steps[0].request_ids == ["c", "a"] and sink.steps[0].accepted == [2, 0]


def _probe(rows: int, stamps: list[int] | None) -> Any:
    """A probe of `rows` rows of 4 tree slots: row r's depths [0, 1, 2, 0], tokens [-1, r, r + 5, -1]..."""
    from types import SimpleNamespace

    import numpy as np

    depths = np.tile(np.array([0, 1, 2, 0], dtype=np.int64), (rows, 1))  # [rows, 4]
    tokens = np.array([[-1, r, r + 5, -1] for r in range(rows)], dtype=np.int64)  # [rows, 4]
    parents = np.tile(np.array([-1, 0, 1, -1], dtype=np.int64), (rows, 1))  # [rows, 4]
    log_probs = np.tile(np.array([0.0, -0.5, -1.0, -np.inf], dtype=np.float32), (rows, 1))  # [rows, 4]
    ranks = np.zeros((rows, 3), dtype=np.int64)  # [rows, depth]: the accepted path's ranks (a chain: all 0)
    return SimpleNamespace(
        depths=depths, tokens=tokens, parents=parents, log_probs=log_probs, ranks=ranks, stamps_ns=stamps
    )


def _stamped_collector() -> tuple[Any, Any]:
    from ddtree.observer import GenerateInfo
    from telemetry.collector import Collector

    sink = _Steps()
    collector = Collector([sink])
    collector.on_session(stamped=True)
    collector.on_generate_start(GenerateInfo("ddtree", 3, None, 0.0, 8, 0, ["a", "b"], [[1], [2]]))
    return collector, sink


def test_a_stamped_step_takes_its_times_and_tree_from_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage i runs from stamp i to stamp i + 1, placed after the host wall time of the step's start; the
    tree's rows are the probe's, for the rows that decoded; no mark is taken and nothing is copied."""
    import numpy as np

    collector, sink = _stamped_collector()
    marks: list[int] = []
    monkeypatch.setattr(collector.clock, "mark", lambda: marks.append(1))
    monkeypatch.setattr("telemetry.collector.time.time_ns", lambda: 1_000_000)
    collector.on_step_start(7, 2)
    stamps = [5_000, 5_300, 5_350, 6_350, 6_400]  # GPU clock ns: draft 300, tree 50, verify 1000, accept 50
    collector.on_probe(7, _probe(2, stamps))
    collector.on_accept(7, None, [1, 0])
    collector.on_step_end(7, [2, 0])  # row 1 did not decode
    assert marks == [], "a stamped step records no event"
    collector._drain()  # ready at once: no wait
    (stats,) = sink.steps
    assert stats.start_ns == 1_000_000 and stats.end_ns == 1_001_400
    assert stats.stage_ns == {
        sc.STAGE_DRAFT: (1_000_000, 1_000_300),
        sc.STAGE_TREE_BUILD: (1_000_300, 1_000_350),
        sc.STAGE_VERIFY: (1_000_350, 1_001_350),
        sc.STAGE_ACCEPT: (1_001_350, 1_001_400),
    }
    assert stats.active == [True, False] and stats.accepted == [1] and stats.emitted == [2]
    assert stats.depths is not None and stats.depths.tolist() == [[0, 1, 2, 0]]
    assert stats.tokens is not None and stats.tokens.tolist() == [[-1, 0, 5, -1]]
    assert stats.parents is not None and stats.parents.tolist() == [[-1, 0, 1, -1]]
    assert stats.path_ranks == [[0]], "the decoding row's ranks, cut to its accepted drafts"
    assert stats.log_probs is not None and np.array_equal(stats.log_probs, [[0.0, -0.5, -1.0, -np.inf]])
    assert stats.tree_nodes == [2] and stats.nodes_per_depth == [0, 1, 1, 0]


def test_a_stamped_sessions_eager_step_is_timed_by_its_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first step of a shape runs eagerly, with stage hooks: its marks start at its first stage hook, and
    its tree still comes from its probe (`on_tree` copies nothing in a session)."""
    collector, sink = _stamped_collector()
    ticks = iter(range(100, 10_000, 100))
    monkeypatch.setattr(collector.clock, "mark", lambda: next(ticks))
    collector.on_step_start(0, 2)
    assert collector.current.marks == []
    for stage in sc.STAGES:
        collector.on_stage_start(stage)
        if stage == sc.STAGE_TREE_BUILD:
            collector.on_tree(object())  # a session's probe brings the tree: this must not touch it
        collector.on_stage_end(stage)
    collector.on_probe(0, _probe(2, None))
    collector.on_accept(0, None, [1, 1])
    collector.on_step_end(0, [2, 2])
    collector._drain()
    (stats,) = sink.steps
    assert stats.end_ns - stats.start_ns == 400, "five marks, 100 ns apart"
    assert [end - start for start, end in stats.stage_ns.values()] == [100] * 4
    assert stats.depths is not None and stats.depths.tolist() == [[0, 1, 2, 0]] * 2
    assert stats.log_probs is not None and stats.log_probs.tolist()[0][:3] == [0.0, -0.5, -1.0]  # the prediction's


def test_stamped_records_reach_the_sinks_in_groups_of_32() -> None:
    from telemetry.collector import STAMPED_DRAIN_EVERY

    collector, sink = _stamped_collector()
    seen = []
    for step in range(2 * STAMPED_DRAIN_EVERY + 3):
        collector.on_step_start(step, 1)
        collector.on_probe(step, _probe(1, [0, 1, 2, 3, 4]))
        collector.on_accept(step, None, [1])
        collector.on_step_end(step, [2])
        seen.append(len(sink.steps))
    assert sorted(set(seen)) == [0, STAMPED_DRAIN_EVERY, 2 * STAMPED_DRAIN_EVERY]
    collector.on_generate_end([])
    assert [s.step for s in sink.steps] == list(range(2 * STAMPED_DRAIN_EVERY + 3))


def test_warmup_steps_are_marked_and_kept_out_of_the_stage_times() -> None:
    """A step the loop says compiles or captures reaches the log marked `warmup`, its span too, and adds
    nothing to the stage-duration histogram; it still counts as a step with its tokens."""
    from ddtree.observer import GenerateInfo

    captured = captured_telemetry()
    collector = captured.collector
    collector.on_generate_start(GenerateInfo("ddtree", 4, None, 0.0, 8, 0, ["r"], [[1]]))
    for step, warmup in enumerate([True, False, False]):
        collector.on_step_start(step, 1, warmup)
        for stage in sc.STAGES:
            collector.on_stage_start(stage)
            collector.on_stage_end(stage)
        collector.on_accept(step, None, [1])  # type: ignore[arg-type]
        collector.on_step_end(step, [2])
    collector.on_generate_end([])
    lines = [x for x in captured.log_lines() if x["event"] == sc.EVENT_STEP]
    assert [x[sc.FIELD_WARMUP] for x in lines] == [True, False, False]
    assert [x[sc.FIELD_ACTIVE_REQUESTS] for x in lines] == [1, 1, 1] and [x[sc.FIELD_ROWS] for x in lines] == [1] * 3
    durations = captured.metric_points()[sc.METRIC_STAGE_DURATION]
    assert {p.attributes[sc.LABEL_STAGE]: p.count for p in durations} == dict.fromkeys(sc.STAGES, 2)
    assert captured.counter(sc.METRIC_STEPS) == 3
    spans = [s for s in captured.spans.get_finished_spans() if s.name == sc.SPAN_STEP]
    assert sorted(s.attributes[sc.ATTR_WARMUP] for s in spans) == [False, False, True]
