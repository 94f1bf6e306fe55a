"""The step runner's plan: what each captured graph runs, and where the hooks and the readout fall.

Capture needs CUDA; the plan (`StepRunner._groups`) and the eager path do not, so they are checked here with
stand-in stages and a stand-in `stamp`.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from ddtree.engine import graphs
from ddtree.engine.graphs import StepRunner
from ddtree.observer import NOOP, NoopObserver
from telemetry import semconv as sc
from tests.helpers import shape_of


class Calls(NoopObserver):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def on_stage_start(self, stage: str) -> None:
        self.log.append(f"start {stage}")

    def on_tree(self, tree: Any) -> None:
        self.log.append("tree")

    def on_stage_end(self, stage: str) -> None:
        self.log.append(f"end {stage}")


class _State:
    """A stand-in step state: the runner sees nothing of a state but its stamps."""

    def __init__(self) -> None:
        self.stamps: torch.Tensor | None = None


def _runner(log: list[str], observer: Any, cuda_graphs: bool, stamped: bool) -> StepRunner[Any]:
    def stage(name: str) -> Any:
        def run(state: Any) -> None:
            log.append(name)

        return run

    stages = [(name, stage(name)) for name in sc.STAGES]
    after = lambda name, state: log.append(f"after {name}")  # noqa: E731
    return StepRunner(stages, observer, cuda_graphs, finish=stage("finish"), stamped=stamped, after_stage=after)


def _plan(runner: StepRunner, log: list[str], monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """What each graph would run, stamps written as `stamp i`."""
    monkeypatch.setattr(graphs, "stamp", lambda buffer, index: log.append(f"stamp {index}"))
    plan = []
    for group in runner._groups():
        log.clear()
        state = _State()
        state.stamps = torch.zeros(len(sc.STAGES) + 1, dtype=torch.int64)  # [stages + 1]
        for run in group:
            run(state)
        plan.append(list(log))
    return plan


def test_a_stamped_step_is_one_graph_with_its_readout_after_the_last_stamp(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    runner = _runner(log, Calls(log), cuda_graphs=True, stamped=True)
    assert not runner.per_stage
    expected = ["stamp 0"] + [x for i, s in enumerate(sc.STAGES) for x in (s, f"stamp {i + 1}")] + ["finish"]
    assert _plan(runner, log, monkeypatch) == [expected]


def test_without_stamps_an_observed_step_is_a_graph_per_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    runner = _runner(log, Calls(log), cuda_graphs=True, stamped=False)
    assert _plan(runner, log, monkeypatch) == [[s] for s in sc.STAGES[:-1]] + [[sc.STAGE_ACCEPT, "finish"]]
    unobserved = _runner(log, NOOP, cuda_graphs=True, stamped=False)
    assert _plan(unobserved, log, monkeypatch) == [[*sc.STAGES, "finish"]]
    assert _runner(log, Calls(log), cuda_graphs=False, stamped=True).stamped is False, "stamps need graphs"


def test_an_eager_step_reads_out_inside_the_last_stage() -> None:
    """The readout is a step of its own, but the accept stage's hooks still enclose it, as they did when the
    accept stage built the readback: host-marked stage times are what they were. The caller's `after_stage`
    falls after each stage's work and before its end hook."""
    log: list[str] = []
    _runner(log, Calls(log), cuda_graphs=False, stamped=False).run(("key",), _State)
    stages = [x for s in sc.STAGES for x in (f"start {s}", s, f"after {s}", f"end {s}")]
    assert log == [*stages[:-2], "finish", *stages[-2:]]


def test_without_a_working_clock_kernel_observed_steps_fall_back_to_a_graph_per_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU where the stamp kernel cannot run (no NVIDIA PTX): a warning, then stage hooks between per-stage
    graphs, as without Triton; decoding goes on."""

    def broken(buffer: torch.Tensor, index: int) -> None:
        raise RuntimeError("no %globaltimer here")

    monkeypatch.setattr(graphs, "stamp", broken)
    log: list[str] = []
    runner = _runner(log, Calls(log), cuda_graphs=True, stamped=True)
    runner.device = "cpu"
    state = _State()
    with pytest.warns(RuntimeWarning, match="no device clock stamps"):
        runner._prepare_stamps(state)
    assert state.stamps is None and not runner.stamped and runner.per_stage
    assert [len(group) for group in runner._groups()] == [1] * (len(sc.STAGES) - 1) + [2]


class _DeferredGraph:
    """Stands in for a captured CUDA graph on CPU: a replay runs the group's Python again."""

    def __init__(self, group: list[Any], state: Any) -> None:
        self.group, self.state = group, state

    def replay(self) -> None:
        for run in self.group:
            run(self.state)


def test_a_stamped_session_simulated_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stamped protocol end to end, with the graphs replaced by deferred Python, one step shape (the key
    span at the cache's capacity, as CUDA's buckets make it) and a clock that ticks 700 ns a stamp: after the
    eager first step, steps get no stage hooks, their stage times are the stamps', their trees come from the
    probe, the tokens are those of an unobserved session, and no hook reads the device."""
    from ddtree.engine.requests import Request
    from ddtree.engine.session import DecodeSession
    from tests.helpers import tiny_pair
    from tests.telemetry.helpers import captured_telemetry
    from tests.telemetry.sync_guard import GuardedObserver, SyncGuard

    ticks = iter(range(10_000, 10**9, 700))
    monkeypatch.setattr(graphs, "stamp", lambda buffer, index: buffer.__setitem__(index, next(ticks)))

    def capture(self: StepRunner[Any], state: Any) -> graphs._Captured[Any]:
        if self.stamped:
            state.stamps = torch.zeros(len(self.stages) + 1, dtype=torch.int64, device=self.device)  # [stages + 1]
        groups = [_DeferredGraph(group, state) for group in self._groups()]
        return graphs._Captured(graphs=groups, state=state, per_stage=self.per_stage)

    monkeypatch.setattr(StepRunner, "_capture", capture)

    def decode(observer: Any) -> list[list[int]]:
        target, drafter = tiny_pair(3, vocab=16, block_size=4)
        session = DecodeSession(
            target, drafter, shape_of("ddtree", 8, None, drafter), 2, 128, observer=observer, pipeline_depth=2
        )
        runner, run = session.runner, session.runner.run
        runner.cuda_graphs, runner.stamped, runner.per_stage = True, observer is not NOOP, False
        if observer is not NOOP:
            observer.on_session(True)  # what a CUDA session with triton says

        def at_capacity(make: Any) -> Any:
            state = make()
            state.span = session.capacity
            return state

        runner.run = lambda key, make: run((key[0], key[2]), lambda: at_capacity(make))  # type: ignore[method-assign]
        slots = session.join([Request([1, 2, 3], 30), Request([4], 25, 0.8, seed=2)])
        while session.has_active():
            session.step()
        session.drain()
        return [session.leave(slot).token_ids for slot in slots]

    plain = decode(NOOP)
    captured, guard = captured_telemetry(), SyncGuard()
    assert decode(GuardedObserver(captured.collector, guard)) == plain
    assert guard.violations == []
    assert guard.calls["on_stage_start"] == len(sc.STAGES) and guard.calls["on_tree"] == 1, "the eager step only"
    steps = [line for line in captured.log_lines() if line["event"] == sc.EVENT_STEP]
    assert len(steps) > 10 and all(sum(line["tree_nodes"]) > 0 for line in steps)
    assert all(line[sc.FIELD_STAGE_MS] == dict.fromkeys(sc.STAGES, 0.0007) for line in steps[1:])
    spans = [s for s in captured.spans.get_finished_spans() if s.name == sc.SPAN_STEP]
    assert all(s.end_time - s.start_time == 4 * 700 for s in spans[1:])


class _Dropped:
    """Stands for a dropped session: garbage in a reference cycle that holds a graph."""

    def __init__(self, log: list[str]) -> None:
        self.cycle = self
        self.log = log

    def __del__(self) -> None:
        self.log.append("graph destroyed")


def test_no_garbage_is_collected_while_a_graph_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """A collection during a capture that frees a dropped session's graph would fail the capture on CUDA: both
    capture paths keep the collector off until the capture ends (each stage leaves garbage and starts a
    collection where an allocation would), and turn it back on after."""
    log: list[str] = []

    class Graph:
        def __enter__(self) -> None:
            log.append("capture")

        def __exit__(self, *exc: object) -> None:
            log.append("end")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: Graph())

    def stage(state: Any) -> None:
        if gc.isenabled():
            gc.collect()
        log.append("stage")
        _Dropped(log)  # garbage for the next stage's collection, if it runs one

    runner = StepRunner([("draft", stage)], NOOP, cuda_graphs=True, finish=stage, stamped=False)
    cache = graphs.GraphCache(cuda_graphs=True)
    for capture in (lambda: runner._capture(_State()), lambda: cache.run(("k",), stage, {})):
        gc.collect()
        log.clear()
        _Dropped(log)
        capture()
        assert gc.isenabled()
        capturing = log[log.index("capture") : log.index("end")]
        assert "stage" in capturing and "graph destroyed" not in capturing
        gc.collect()
        assert log[-1] == "graph destroyed"
