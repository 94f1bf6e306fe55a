from __future__ import annotations

from typing import Any

from ddtree.engine.engine import Engine
from ddtree.methods import TreeShape
from ddtree.observer import NOOP, NoopObserver
from ddtree.settings import GenerationConfig
from telemetry import semconv
from tests.helpers import random_prompts, tiny_pair


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def on_step_start(self, step: int, batch_size: int, warmup: bool = False, shape: TreeShape | None = None) -> None:
        self.calls.append(("step_start", step))

    def on_stage_start(self, stage: str) -> None:
        self.calls.append(("start", stage))

    def on_stage_end(self, stage: str) -> None:
        self.calls.append(("end", stage))

    def on_tree(self, tree: Any) -> None:
        self.calls.append(("tree", int(tree.width)))

    def on_session(self, stamped: bool) -> None:
        self.calls.append(("session", stamped))

    def on_probe(self, step: int, probe: Any) -> None:
        self.calls.append(("probe", probe.depths.shape))

    def on_accept(self, step: int, result: Any, accepted: list[int]) -> None:
        self.calls.append(("accept", accepted))

    def on_step_end(self, step: int, emitted: list[int]) -> None:
        self.calls.append(("step_end", emitted))

    def on_generate_start(self, info: Any) -> None:
        self.calls.append(("generate_start", info.request_ids))

    def on_generate_end(self, results: Any) -> None:
        self.calls.append(("generate_end", [len(r.output_tokens) for r in results]))


def test_every_step_passes_the_four_stages_in_order() -> None:
    target, drafter = tiny_pair(0, vocab=16)
    rec = Recorder()
    out = Engine(target, drafter, observer=rec).generate(
        random_prompts(0, 2, vocab=16), GenerationConfig(method="ddtree", budget=8, max_new_tokens=10)
    )
    per_step = [c for c in rec.calls if c[0] in ("start", "end")]
    expected = [(kind, s) for s in semconv.STAGES for kind in ("start", "end")]
    assert per_step == expected * out.steps
    accepted = [c[1] for c in rec.calls if c[0] == "accept"]
    first = out.outputs[0].acceptance_lengths
    assert [a[0] for a in accepted][: len(first)] == [a - 1 for a in first]
    assert ("tree", 9) in rec.calls
    # The session announces itself (on CPU: no stamps), then each request as it joins its slot and leaves.
    assert rec.calls[0] == ("session", False)
    joined = rec.calls[1:3]
    assert [c[0] for c in joined] == ["generate_start"] * 2 and all(len(c[1]) == 1 for c in joined)
    # Each step's probe (the tree's rows: one per row of the step, 9 slots) comes right before its accept.
    kinds = [c[0] for c in rec.calls]
    assert kinds.count("probe") == kinds.count("accept") > 0
    assert all(kinds[i + 1] == "accept" and rec.calls[i][1][1] == 9 for i, k in enumerate(kinds) if k == "probe")
    assert rec.calls[-2:] == [("generate_end", [10]), ("generate_end", [10])]
    emitted = [c[1] for c in rec.calls if c[0] == "step_end"]
    # A step runs the first slots up to the last one decoding: once slot 1 is done, steps have one row.
    assert [sum(e[b] for e in emitted if len(e) > b) for b in range(2)] == [9, 9], "the first token: prefill"


def test_the_default_observer_is_the_noop() -> None:
    target, _ = tiny_pair(0)
    assert Engine(target).observer is NOOP
    assert isinstance(NOOP, NoopObserver)
