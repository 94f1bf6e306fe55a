"""A stream behind its engine: the steps it caught up on go out in one write, one SSE event each."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from ddtree.engine.requests import Request
from ddtree.server.app import _events
from ddtree.server.generation import Generation
from ddtree.server.metrics import ServerMetrics
from ddtree.server.responses import Reply
from ddtree.server.text import TextStream
from ddtree.server.worker import Job, Update


class Letters:
    """A tokenizer whose token i is the letter 'a' + i."""

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class Link:
    alive = True

    def submit(self, job: Job) -> None:
        pass

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        pass


def generation(interval: int = 1) -> Generation:
    metrics = ServerMetrics(lambda: 0, lambda: 0)
    meter = metrics.meter("/v1/completions", False, 0.0)
    text = TextStream(Letters(), [0], [])
    return Generation(Link(), Request([0], 8), text, meter, interval)  # type: ignore[arg-type]


STATE = SimpleNamespace(
    model=SimpleNamespace(card=SimpleNamespace(schedule=None, adaptive=False, method="ar", tree_budget=1, tree_topk=1))
)


def test_ready_says_whether_a_piece_waits() -> None:
    async def run() -> None:
        gen = generation(interval=2)
        assert not gen.ready()
        gen.job.deliver(Update([1], [1], [0]))
        assert not gen.ready()  # one token of the two a piece gathers
        gen.job.deliver(Update([2], [1], [0]))
        assert gen.ready()
        assert await gen.next_text() == "bc"
        assert not gen.ready()
        gen.job.deliver(Update([], [], finish_reason="length"))
        assert gen.ready()  # the end needs no more tokens

    asyncio.run(run())


async def _writes(updates: list[Update], apart: bool) -> list[str]:
    gen = generation()
    reply = Reply("cmpl-1", 0, "m", chat=False)
    writes = []
    if not apart:
        for update in updates:
            gen.job.deliver(update)
    events = _events(STATE, gen, reply)  # type: ignore[arg-type]
    pending = list(updates) if apart else []
    if pending:
        gen.job.deliver(pending.pop(0))
    async for chunk in events:
        writes.append(chunk)
        if pending:
            gen.job.deliver(pending.pop(0))
    return writes


def test_steps_that_wait_together_go_out_in_one_write() -> None:
    updates = [Update([1], [1], [0]), Update([2, 3], [1, 1], [0, 0]), Update([4], [1], [0], finish_reason="length")]
    together = asyncio.run(_writes(updates, apart=False))
    apart = asyncio.run(_writes(updates, apart=True))
    assert len(together) == 1 and len(apart) == 3
    assert "".join(together) == "".join(apart)  # the same events either way
    events = [e for e in "".join(together).split("\n\n") if e]
    assert [e.count('"text"') for e in events[:3]] == [1, 1, 1]  # an event per step
    assert events[-1] == "data: [DONE]"
