"""Log-probabilities of the emitted tokens: the target's raw log-softmax at the node where each token was
chosen, read back with the tokens, the same as running the target alone on the prompt and the tokens before."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ddtree.engine.engine import Engine
from ddtree.engine.logprobs import LogprobLayout, read_row
from ddtree.engine.requests import Request, RequestOutput
from ddtree.engine.session import DecodeSession
from ddtree.observer import NoopObserver
from ddtree.settings import GenerationConfig
from tests.helpers import random_prompts, shape_of, tiny_pair

VOCAB = 24


def _reference(target: object, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """`[len(tokens), vocab]` float64: log-softmax of the target's own logits before each emitted token."""
    model = target.model  # type: ignore[attr-defined]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()  # [prompt + tokens, vocab]
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], dim=-1)


def _check(target: object, prompt: list[int], out: RequestOutput, top: int) -> None:
    """`out`'s log-probabilities and its `top` alternatives per token equal the target's, run alone."""
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids) > 0
    expected = _reference(target, prompt, out.token_ids)
    for j, token in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[j], float(expected[j, token]), rel_tol=0, abs_tol=1e-9), j
        alternatives = out.top_logprobs[j]
        assert len(alternatives) == min(top, VOCAB)
        values = [v for _, v in alternatives]
        assert values == sorted(values, reverse=True), "most probable first"
        for token_id, value in alternatives:
            assert math.isclose(value, float(expected[j, token_id]), rel_tol=0, abs_tol=1e-9), (j, token_id)
        cut = values[-1] if values else math.inf
        best = {i for i in range(VOCAB) if float(expected[j, i]) > cut + 1e-9}
        assert best <= {i for i, _ in alternatives}, "no token more probable than the last is missing"
        if top and out.logprobs[j] > cut + 1e-9:
            assert token in {i for i, _ in alternatives}, "the chosen token where it is among the top"


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.0, 1.0, 0), (0.8, 0.9, 0), (1.2, 1.0, 5)])
def test_logprobs_are_the_targets_own_and_leave_the_tokens_as_they_are(
    method: str, temperature: float, top_p: float, top_k: int
) -> None:
    target, drafter = tiny_pair(3, vocab=VOCAB, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(4, 3, vocab=VOCAB)
    plain = GenerationConfig(method=method, budget=8, temperature=temperature, seed=2, max_new_tokens=14)
    plain = GenerationConfig(**{**plain.__dict__, "top_p": top_p, "top_k": top_k})
    without = engine.generate(prompts, plain).outputs
    with_lp = engine.generate(prompts, GenerationConfig(**{**plain.__dict__, "logprobs": 5})).outputs
    assert [o.token_ids for o in with_lp] == [o.token_ids for o in without]
    assert all(o.logprobs == [] and o.top_logprobs == [] for o in without), "asked for none: none"
    if method != "ar":
        assert any(a > 1 for o in with_lp for a in o.acceptance_lengths), "drafts accepted"
    for prompt, out in zip(prompts, with_lp, strict=True):
        _check(target, prompt, out, 5)


@pytest.mark.parametrize("method", ["ar", "ddtree"])
@pytest.mark.parametrize("depth", [1, 2])
def test_continuous_batching_mixes_requests_with_and_without_logprobs(method: str, depth: int) -> None:
    """Requests join between steps, some asking for log-probabilities (0, 3 or all 20 alternatives) and some
    not; each gets its own, and the same tokens as without."""
    target, drafter = tiny_pair(5, vocab=VOCAB, block_size=5)
    prompts = random_prompts(8, 5, vocab=VOCAB)
    asks = [None, 3, 0, 20, None]
    news = [9, 14, 6, 11, 12]

    def run(ask: list[int | None]) -> dict[int, RequestOutput]:
        shape = shape_of(method, 8, None, drafter)
        session = DecodeSession(target, drafter, shape, slots=2, capacity=128, pipeline_depth=depth)
        rows = enumerate(zip(prompts, news, ask, strict=True))
        waiting = [Request(p, n, 0.9, seed=40 + i, logprobs=a) for i, (p, n, a) in rows]
        slot_of: dict[int, int] = {}
        done: dict[int, RequestOutput] = {}
        while waiting or session.has_active():
            if waiting and session.free_slots():
                index = len(prompts) - len(waiting)
                slot_of[index] = session.join([waiting.pop(0)])[0]
            if session.has_active():
                session.step()
            for index, slot in list(slot_of.items()):
                if session.output(slot).finished:
                    done[index] = session.leave(slot)
                    del slot_of[index]
        return done

    with_lp, without = run(asks), run([None] * len(asks))
    for i, ask in enumerate(asks):
        assert with_lp[i].token_ids == without[i].token_ids and len(with_lp[i].token_ids) == news[i], i
        if ask is None:
            assert with_lp[i].logprobs == [] and with_lp[i].top_logprobs == [], i
        else:
            _check(target, prompts[i], with_lp[i], ask)
            assert ask or all(t == [] for t in with_lp[i].top_logprobs), "0: the chosen token's alone"


def test_stream_and_an_observer_keep_the_logprobs() -> None:
    """`Engine.stream` (continuous batching) and a session whose readback also carries the probe."""
    target, drafter = tiny_pair(9, vocab=VOCAB, block_size=4)
    prompts = random_prompts(2, 4, vocab=VOCAB)
    cfg = GenerationConfig(method="ddtree", budget=6, temperature=0.7, seed=1, max_new_tokens=10, logprobs=2)
    streamed = Engine(target, drafter).stream(prompts, cfg, slots=2).outputs
    observed = Engine(target, drafter, observer=NoopObserver()).generate(prompts, cfg).outputs
    for prompt, a, b in zip(prompts, streamed, observed, strict=True):
        assert a.token_ids == b.token_ids
        _check(target, prompt, a, 2)
        _check(target, prompt, b, 2)


def test_an_end_of_sequence_token_keeps_the_lists_beside_the_tokens() -> None:
    target, drafter = tiny_pair(3, vocab=VOCAB, block_size=5)
    engine = Engine(target, drafter)
    prompt = [4, 8, 15]
    full = engine.generate([prompt], GenerationConfig(method="ddtree", budget=8, max_new_tokens=20)).outputs[0]
    stop = full.token_ids[6]
    cfg = GenerationConfig(method="ddtree", budget=8, max_new_tokens=20, eos_token_ids=(stop,), logprobs=1)
    out = engine.generate([prompt], cfg).outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop) + 1] and out.finish_reason == "stop"
    _check(target, prompt, out, 1)


def test_a_row_of_columns_reads_back_exactly() -> None:
    """Two path slots with 3 alternatives each: the first `count` tokens, `top` alternatives each."""
    layout = LogprobLayout(2, 3)
    chosen = np.array([-0.5, -1.25])
    ids = np.array([[4, 1, 7], [2, 4, 0]])
    values = np.array([[-0.5, -2.0, -3.0], [-0.25, -1.25, -4.0]])
    row = np.concatenate([chosen.view(np.int64), ids.ravel(), values.ravel().view(np.int64)])
    assert row.shape == (layout.columns,)
    assert read_row(row, layout, 2, 2) == ([-0.5, -1.25], [[(4, -0.5), (1, -2.0)], [(2, -0.25), (4, -1.25)]])
    assert read_row(row, layout, 1, 0) == ([-0.5], [[]])
