"""The slot-based session: requests join and leave between steps, and each slot's output is its own."""

from __future__ import annotations

from typing import Any

import pytest

from ddtree.engine.engine import Engine
from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from ddtree.methods import TreeShape
from ddtree.observer import NoopObserver
from ddtree.settings import GenerationConfig
from tests.helpers import random_prompts, shape_of, tiny_pair


class Rows(NoopObserver):
    """Records the rows each step runs."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def on_step_start(self, step: int, batch_size: int, warmup: bool = False, shape: TreeShape | None = None) -> None:
        self.rows.append(batch_size)


def _alone(engine: Engine, prompt: list[int], method: str, new: int, temperature: float, seed: int) -> list[int]:
    cfg = GenerationConfig(method=method, budget=8, temperature=temperature, seed=seed, max_new_tokens=new)
    return engine.generate([prompt], cfg).outputs[0].token_ids


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("depth", [1, 2])
def test_requests_joining_between_steps_get_the_tokens_they_get_alone(
    method: str, temperature: float, depth: int
) -> None:
    """Depth 2 launches each step before the last one's tokens are read (as on a GPU): same tokens."""
    target, drafter = tiny_pair(5, vocab=20, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(8, 5, vocab=20)
    news = [12, 25, 7, 18, 30]
    session = DecodeSession(
        target, drafter, shape_of(method, 8, None, drafter), slots=3, capacity=160, pipeline_depth=depth
    )
    waiting = [Request(p, n, temperature, seed=40 + i) for i, (p, n) in enumerate(zip(prompts, news, strict=True))]
    slot_of: dict[int, int] = {}
    done: dict[int, list[int]] = {}
    steps = 0
    while waiting or session.has_active():
        if waiting and session.free_slots() and steps % 2 == 0:  # join one at a time, every other step
            index = len(prompts) - len(waiting)
            slot_of[index] = session.join([waiting.pop(0)])[0]
        if session.has_active():
            session.step()
        for index, slot in list(slot_of.items()):
            if session.output(slot).finished:
                done[index] = session.leave(slot).token_ids
                del slot_of[index]
        steps += 1
    for i, prompt in enumerate(prompts):
        assert done[i] == _alone(engine, prompt, method, news[i], temperature, 40 + i), f"request {i}"
        assert len(done[i]) == news[i]


def test_a_reused_slot_forgets_its_last_request() -> None:
    target, drafter = tiny_pair(6, vocab=16, block_size=4)
    session = DecodeSession(target, drafter, shape_of("ddtree", 16, None, drafter), slots=1, capacity=96)
    first = session.join([Request([1, 2, 3, 4, 5, 6, 7, 8], 20)])[0]
    while session.has_active():
        session.step()
    long_one = session.leave(first).token_ids
    second = session.join([Request([9], 10)])[0]
    while session.has_active():
        session.step()
    assert second == first
    assert session.leave(second).token_ids == _alone(Engine(target, drafter), [9], "ddtree", 10, 0.0, 0)
    assert long_one == _alone(Engine(target, drafter), [1, 2, 3, 4, 5, 6, 7, 8], "ddtree", 20, 0.0, 0)


def test_finished_slots_stay_masked_while_others_decode() -> None:
    target, drafter = tiny_pair(7, vocab=16, block_size=4)
    session = DecodeSession(target, drafter, shape_of("ddtree", 8, None, drafter), slots=2, capacity=96)
    short, long = session.join([Request([1, 2], 2), Request([3, 4], 30)])
    emitted_after_finish = []
    while session.has_active():
        emitted = session.step()
        if session.output(short).finished:
            emitted_after_finish.append(emitted[short])
    assert len(session.output(short).token_ids) == 2
    assert len(session.output(long).token_ids) == 30
    assert emitted_after_finish[1:] and all(e == 0 for e in emitted_after_finish[1:])


def test_session_errors_speak_of_values() -> None:
    target, drafter = tiny_pair(8, vocab=16, block_size=4)
    session = DecodeSession(target, drafter, shape_of("ddtree", 8, None, drafter), slots=1, capacity=64)
    with pytest.raises(ValueError, match="cache slots"):
        session.join([Request([1] * 40, 30)])
    with pytest.raises(ValueError, match="free slots"):
        session.join([Request([1], 4), Request([2], 4)])
    with pytest.raises(ValueError, match="temperature"):
        session.join([Request([1], 4, temperature=-1.0)])
    if target.device.type != "cuda":
        with pytest.raises(ValueError, match="CUDA graphs"):
            DecodeSession(target, drafter, shape_of("ddtree", 8, None, drafter), 1, 64, cuda_graphs=True)
    with pytest.raises(ValueError, match="unknown method"):
        DecodeSession(target, drafter, shape_of("beam", 8, None, drafter), slots=1, capacity=64)


def test_steps_run_only_the_slots_up_to_the_last_one_decoding() -> None:
    target, drafter = tiny_pair(9, vocab=16, block_size=4)
    rows = Rows()
    session = DecodeSession(target, drafter, shape_of("ddtree", 8, None, drafter), slots=3, capacity=96, observer=rows)
    long, short = session.join([Request([1, 2], 24), Request([3], 3)])
    while session.has_active():
        session.step()
    assert rows.rows[0] == 2 and rows.rows[-1] == 1, "two rows while slot 1 decodes, then one"
    alone = Engine(target, drafter).generate([[1, 2]], GenerationConfig(method="ddtree", budget=8, max_new_tokens=24))
    assert session.leave(long).token_ids == alone.outputs[0].token_ids
    assert len(session.leave(short).token_ids) == 3
    session.join([Request([4], 2), Request([5], 2), Request([6], 8)])
    rows.rows.clear()
    while session.has_active():
        session.step()
    assert rows.rows[0] == 3, "a power of two past the last slot decoding, at most the session's slots"


def test_warm_up_leaves_an_empty_session_whose_requests_are_their_own() -> None:
    """The server warms a session before serving: every row count runs, the observer sees none of it, and the
    requests that follow get the tokens they would get from a fresh session (at T=0 and seeded T>0)."""
    target, drafter = tiny_pair(10, vocab=16, block_size=4)
    calls = Rows()
    session = DecodeSession(target, drafter, shape_of("ddtree", 8, None, drafter), slots=3, capacity=96, observer=calls)
    seen: list[int] = []
    original = session._rows

    def rows(n: int) -> Any:
        seen.append(n)
        return original(n)

    session._rows = rows  # type: ignore[method-assign]
    session.warm_up()
    assert calls.rows == [], "the observer saw the warm-up"
    assert sorted(set(seen)) == [1, 2, 3], "every row count a step of 3 slots can have"
    assert session.free_slots() == [0, 1, 2] and session.runner.observer is calls
    with pytest.raises(ValueError, match="empty session"):
        busy = DecodeSession(target, drafter, shape_of("ddtree", 8, None, drafter), slots=1, capacity=96)
        busy.join([Request([1], 4)])
        busy.warm_up()
    engine = Engine(target, drafter)
    for temperature, seed in ((0.0, 0), (0.9, 3)):
        slot = session.join([Request([5, 6, 7], 12, temperature, seed)])[0]
        while session.has_active():
            session.step()
        assert session.leave(slot).token_ids == _alone(engine, [5, 6, 7], "ddtree", 12, temperature, seed)


class Probes(NoopObserver):
    """Keeps each step's tree as `on_tree` sees it (device tensors, cloned) and the probe `on_probe` gets."""

    def __init__(self) -> None:
        self.sessions: list[bool] = []
        self.current = -1
        self.trees: dict[int, Any] = {}
        self.probes: dict[int, Any] = {}

    def on_session(self, stamped: bool) -> None:
        self.sessions.append(stamped)

    def on_step_start(self, step: int, batch_size: int, warmup: bool = False, shape: TreeShape | None = None) -> None:
        self.current = step

    def on_tree(self, tree: Any) -> None:
        fields = ("depths", "tokens", "parents", "log_probs")
        self.trees[self.current] = {name: getattr(tree, name).clone() for name in fields}

    def on_probe(self, step: int, probe: Any) -> None:
        self.probes[step] = probe


def _decode(session: DecodeSession, requests: list[Request]) -> list[list[int]]:
    slots = session.join(requests)
    while session.has_active():
        session.step()
    session.drain()
    return [session.leave(slot).token_ids for slot in slots]


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize("depth", [1, 2])
def test_an_observed_session_reads_the_tree_back_with_the_same_tokens(method: str, depth: int) -> None:
    """With an observer the readback carries a probe: the tokens are those of an unobserved session, and each
    step's probe holds that step's tree (no stamps on CPU: stage times come from the stage hooks)."""
    import numpy as np

    target, drafter = tiny_pair(11, vocab=16, block_size=4)
    requests = [Request([1, 2, 3], 14, 0.0), Request([4, 5], 9, 0.9, seed=5)]
    plain = DecodeSession(
        target, drafter, shape_of(method, 8, None, drafter), slots=2, capacity=96, pipeline_depth=depth
    )
    probes = Probes()
    observed = DecodeSession(
        target, drafter, shape_of(method, 8, None, drafter), 2, 96, observer=probes, pipeline_depth=depth
    )
    assert _decode(observed, requests) == _decode(plain, requests)
    assert probes.sessions == [False], "told once, and not stamped on CPU"
    assert sorted(probes.probes) == sorted(probes.trees) == list(range(observed.steps))
    for step, probe in probes.probes.items():
        tree = probes.trees[step]
        assert probe.stamps_ns is None
        for name in ("depths", "tokens", "parents", "log_probs"):
            assert np.array_equal(getattr(probe, name), tree[name].cpu().numpy()), (step, name)


def test_an_unobserved_session_reads_back_the_tokens_alone() -> None:
    """Off means off: the readback is the accepted count, the path's tokens and the bonus, nothing more."""
    target, drafter = tiny_pair(12, vocab=16, block_size=4)
    for observer, probed in ((NoopObserver(), True), (None, False)):  # any observer but NOOP itself reads a probe
        kwargs = {} if observer is None else {"observer": observer}
        session = DecodeSession(
            target, drafter, shape_of("ddtree", 8, None, drafter), 1, 96, pipeline_depth=2, **kwargs
        )
        session.join([Request([1, 2], 8)])
        session.step()  # two steps launched, one read
        state = session._inflight[0].state
        path = state.result.path_tokens.shape[1]
        assert (state.layout is not None) is probed
        width = state.out.shape[1]
        assert width == (state.layout.width if state.layout is not None else 2 + path)


@pytest.mark.parametrize(("method", "temperature", "depth"), [("ar", 0.0, 1), ("dflash", 0.7, 2), ("ddtree", 0.0, 2)])
def test_stream_gives_each_prompt_what_generate_gives_it(method: str, temperature: float, depth: int) -> None:
    """Seven prompts through two slots: requests join as slots free up, in prompt order, and each prompt's
    output (sampled ones included: request i samples with seed + i) equals `generate`'s for the whole batch."""
    target, drafter = tiny_pair(7, vocab=32, block_size=4)
    engine = Engine(target, drafter, pipeline_depth=depth)
    prompts = random_prompts(8, 7, vocab=32)
    config = GenerationConfig(method=method, budget=8, temperature=temperature, seed=5, max_new_tokens=9)
    eos_config = GenerationConfig(**{**config.__dict__, "eos_token_ids": (3, 11)})
    for cfg in (config, eos_config):
        together = engine.generate(prompts, cfg)
        streamed = engine.stream(prompts, cfg, slots=2)
        assert [o.token_ids for o in streamed.outputs] == [o.token_ids for o in together.outputs]
        assert [o.acceptance_lengths for o in streamed.outputs] == [o.acceptance_lengths for o in together.outputs]
        assert streamed.steps > together.steps, "two slots take more steps than seven"
    assert {key[-1] for key in engine.sessions} == {2, 7}, "a session of two slots served the stream"


def test_stream_errors_speak_of_values() -> None:
    engine = Engine(*tiny_pair(7, vocab=32, block_size=4))
    with pytest.raises(ValueError, match="slots must be >= 1, got 0"):
        engine.stream([[1, 2]], GenerationConfig(), slots=0)
    with pytest.raises(ValueError, match="prompt has no tokens"):
        engine.stream([[1], []], GenerationConfig(), slots=2)


def test_a_join_reads_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A join launches its prefill and returns: the first token is read with the next step's tokens (a
    blocking read there would drain the steps in flight at every join), or at `leave`."""
    from ddtree.engine.readback import Readback

    target, drafter = tiny_pair(13, vocab=24, block_size=4)
    engine = Engine(target, drafter)
    session = DecodeSession(
        target, drafter, shape_of("ddtree", 8, None, drafter), slots=2, capacity=96, pipeline_depth=2
    )
    reads: list[str] = []
    for name in ("wait", "wait_array"):
        original = getattr(Readback, name)

        def counted(self: Readback, ticket: Any, _original: Any = original, _name: str = name) -> Any:
            reads.append(_name)
            return _original(self, ticket)

        monkeypatch.setattr(Readback, name, counted)
    slot = session.join([Request([1, 2, 3], 10)])[0]
    assert reads == [] and session.output(slot).token_ids == []
    session.step()
    alone = _alone(engine, [1, 2, 3], "ddtree", 10, 0.0, 0)
    got = session.output(slot).token_ids
    assert got and got == alone[: len(got)], "the prefill's token, then the step's, as alone"
    other = session.join([Request([4, 5], 6)])[0]
    assert session.leave(other).token_ids == _alone(engine, [4, 5], "ddtree", 6, 0.0, 0)[:1], "read at leave"


@pytest.mark.parametrize("depth", [1, 2])
def test_a_request_that_its_prefill_token_ends_keeps_that_token_alone(depth: int) -> None:
    """One new token, or a first token that is end-of-sequence: the request decodes in the steps launched
    before that token is read, but keeps only it, as `generate` does, and its neighbour is undisturbed."""
    target, drafter = tiny_pair(14, vocab=24, block_size=4)
    engine = Engine(target, drafter, pipeline_depth=depth)
    prompt, other = [2, 7, 1], [5, 5, 9, 3]
    first = _alone(engine, prompt, "ddtree", 1, 0.0, 0)[0]
    for request in (Request(prompt, 1), Request(prompt, 12, eos_token_ids=(first,))):
        session = DecodeSession(target, drafter, shape_of("ddtree", 8, None, drafter), 2, 96, pipeline_depth=depth)
        short, long = session.join([request, Request(other, 12)])
        while session.has_active():
            session.step()
        session.drain()
        out = session.leave(short)
        assert out.token_ids == [first] and out.acceptance_lengths == [] and out.finished
        assert out.finish_reason == ("length" if request.max_new_tokens == 1 else "stop")
        assert session.leave(long).token_ids == _alone(engine, other, "ddtree", 12, 0.0, 0)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_join_run_in_groups_of_row_counts_gives_each_request_its_own_tokens(depth: int) -> None:
    """Seven requests joining at once in eight slots prefill as groups of 4, 2 and 1 (as on CUDA, where each
    group replays a graph warm-up captured): greedy, sampled and scored, each gets what it gets alone."""
    target, drafter = tiny_pair(5, vocab=20, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(9, 7, vocab=20)
    session = DecodeSession(
        target, drafter, shape_of("ddtree", 8, None, drafter), slots=8, capacity=160, pipeline_depth=depth
    )
    session.grouped_prefill = True
    groups: list[int] = []
    prefill = session._prefill_group
    session._prefill_group = lambda ids, requests: groups.append(len(requests)) or prefill(ids, requests)  # type: ignore[method-assign]
    temperatures = [0.0, 0.8, 0.0, 0.8, 0.0, 0.8, 0.0]
    requests = [
        Request(p, 14, t, seed=60 + i, logprobs=1 if i % 3 == 0 else None)
        for i, (p, t) in enumerate(zip(prompts, temperatures, strict=True))
    ]
    slots = session.join(requests)
    assert groups == [4, 2, 1]
    while session.has_active():
        session.step()
    session.drain()
    for i, (slot, prompt, t) in enumerate(zip(slots, prompts, temperatures, strict=True)):
        out = session.leave(slot)
        assert out.token_ids == _alone(engine, prompt, "ddtree", 14, t, 60 + i), f"request {i}"
        assert (len(out.logprobs) == 14) == (i % 3 == 0)


def test_a_request_joining_behind_a_step_in_flight_gets_its_first_token_at_the_next_step_end() -> None:
    """Pipelined, a join lands while a step is in flight; the next `step` finishes that older step (without
    the request) and hands the request its prefill's token, whose copy has arrived, before the step that
    decodes it is read."""
    target, drafter = tiny_pair(13, vocab=24, block_size=4)
    engine = Engine(target, drafter)
    session = DecodeSession(
        target, drafter, shape_of("ddtree", 8, None, drafter), slots=2, capacity=96, pipeline_depth=2
    )
    first = session.join([Request([1, 2, 3], 10)])[0]
    session.step()  # two steps launched, one read: one stays in flight
    late = session.join([Request([4, 5], 9)])[0]
    session.step()  # reads the step launched before the join
    alone = _alone(engine, [4, 5], "ddtree", 9, 0.0, 0)
    assert session.output(late).token_ids == alone[:1] and session.output(late).acceptance_lengths == []
    while session.has_active():
        session.step()
    session.drain()
    assert session.leave(late).token_ids == alone
    assert session.leave(first).token_ids == _alone(engine, [1, 2, 3], "ddtree", 10, 0.0, 0)
