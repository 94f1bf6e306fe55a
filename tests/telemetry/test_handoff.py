"""The collector's hand-off thread: order, flush, failures that never reach the caller, and a bound."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from telemetry.handoff import HandOff


def test_calls_run_in_order_on_another_thread() -> None:
    handoff = HandOff()
    seen: list[tuple[int, int]] = []
    for i in range(50):
        handoff.post(lambda i=i: seen.append((i, threading.get_ident())))
    assert handoff.flush(timeout_s=10)
    assert [i for i, _ in seen] == list(range(50))
    assert {ident for _, ident in seen} == {handoff.thread.ident} != {threading.get_ident()}
    handoff.close(timeout_s=10)
    assert not handoff.thread.is_alive()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_failing_call_is_reported_once_and_the_next_ones_still_run() -> None:
    handoff = HandOff()
    seen: list[int] = []

    def broken() -> None:
        raise ValueError("a telemetry bug")

    handoff.post(broken)
    handoff.post(broken)
    handoff.post(seen.append, 1)
    assert handoff.flush(timeout_s=10)
    assert seen == [1] and handoff.warned == {"ValueError"}
    handoff.close(timeout_s=10)


def test_behind_it_refuses_step_records_but_never_starts_and_ends() -> None:
    """A stuck thread: droppable calls past the limit are refused (`post` says so, for the caller to count),
    the others kept, and `flush` gives up after its timeout instead of hanging."""
    handoff = HandOff(limit=3)
    release = threading.Event()
    seen: list[Any] = []
    handoff.post(release.wait)
    taken = [handoff.post(seen.append, ("step", i), droppable=True) for i in range(6)]
    handoff.post(seen.append, ("end", 0))
    assert not handoff.flush(timeout_s=0.05)
    release.set()
    assert handoff.flush(timeout_s=10)
    steps = [i for kind, i in seen if kind == "step"]
    assert 0 < len(steps) < 6 and steps == sorted(steps)
    assert steps == [i for i, ok in enumerate(taken) if ok], "exactly the refused ones are missing"
    assert seen[-1] == ("end", 0)
    handoff.close(timeout_s=10)


def test_with_handoff_the_sinks_get_the_same_steps_as_without() -> None:
    """The same hook calls give the sinks the same records, in the same order, whichever thread resolves them."""
    from ddtree.observer import GenerateInfo, RequestResult
    from telemetry import semconv as sc
    from telemetry.collector import Collector

    class Sink:
        def __init__(self) -> None:
            self.calls: list[tuple[str, Any]] = []

        def start_requests(self, info: GenerateInfo) -> None:
            self.calls.append(("start", info.request_ids))

        def step(self, stats: Any) -> None:
            self.calls.append(("step", (stats.step, stats.accepted, stats.emitted, list(stats.stage_ns))))

        def end_requests(self, info: GenerateInfo, results: Any) -> None:
            self.calls.append(("end", info.request_ids))

    def drive(collector: Collector) -> None:
        collector.on_generate_start(GenerateInfo("ddtree", 4, None, 0.0, 8, 0, ["a", "b"], [[1], [2]]))
        for step in range(40):
            collector.on_step_start(step, 2)
            for stage in sc.STAGES:
                collector.on_stage_start(stage)
                collector.on_stage_end(stage)
            collector.on_accept(step, None, [step % 3, 1])  # type: ignore[arg-type]
            collector.on_step_end(step, [step % 3 + 1, 0 if step % 5 == 0 else 2])
        collector.on_generate_end([RequestResult(rid, [1, 2], [1, 2], "stop") for rid in ("b", "a")])

    inline, threaded = Sink(), Sink()
    drive(Collector([inline]))  # type: ignore[list-item]
    collector = Collector([threaded], handoff=True)  # type: ignore[list-item]
    drive(collector)
    assert collector.flush(timeout_s=10)
    collector.close()
    assert threaded.calls == inline.calls and len(inline.calls) == 42 and inline.calls[-1] == ("end", ["b", "a"])
