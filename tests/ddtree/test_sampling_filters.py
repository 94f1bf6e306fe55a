"""Top-k and top-p: the kept sets on hand-made distributions, and, at T != 1, ar's, dflash's and ddtree's tokens
following the target's processed distribution (temperature, then top-k, then top-p), as vLLM defines it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddtree.engine.engine import Engine
from ddtree.engine.requests import Request
from ddtree.engine.session import DecodeSession
from ddtree.sampling import choose_tokens, keep_mask
from ddtree.settings import GenerationConfig
from tests.ddtree.test_sampling import PROMPT, VOCAB, pooled_chisquare, target_probs
from tests.helpers import random_prompts, shape_of, tiny_pair

DRAWS = 4000


def processed(probs: np.ndarray, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """The reference filter, one distribution at a time (`[..., vocab]`): the k most probable, renormalised, then
    the most probable of those until their mass reaches p, renormalised."""
    flat = probs.reshape(-1, probs.shape[-1])
    out = np.zeros_like(flat)
    for row, p in zip(out, flat, strict=True):
        order = sorted(range(len(p)), key=lambda i: -p[i])
        kept = order[:top_k] if top_k else order
        total, mass, chosen = sum(p[i] for i in kept), 0.0, []
        for i in kept:
            if mass >= top_p * total:
                break
            chosen.append(i)
            mass += p[i]
        row[chosen] = p[chosen] / mass
    return out.reshape(probs.shape)


def _mask(probs: list[float], top_p: float = 1.0, top_k: int = 0) -> list[int]:
    """The kept token ids of one hand-made distribution."""
    t = torch.tensor(probs)[None, None]  # [1, 1, vocab]
    kept = keep_mask(t, torch.tensor([top_p]), torch.tensor([top_k]))[0, 0]
    return torch.nonzero(kept).flatten().tolist()


def test_the_kept_sets_of_hand_made_distributions() -> None:
    probs = [0.125, 0.5, 0.0625, 0.25, 0.0625]  # dyadic: sums are exact; ranked 1, 3, 0, {2, 4}
    assert _mask(probs, top_k=1) == [1]
    assert _mask(probs, top_k=2) == [1, 3]
    assert _mask(probs, top_p=0.5) == [1], "0.5 reaches 0.5: one token"
    assert _mask(probs, top_p=0.51) == [1, 3]
    assert _mask(probs, top_p=0.8) == [0, 1, 3]
    assert _mask(probs, top_p=1e-6) == [1], "at least one token"
    assert _mask(probs, top_k=3, top_p=0.6) == [1, 3], "top-p within the top 3: 0.5 of 0.875 < 0.6"
    assert _mask(probs, top_k=2, top_p=0.6) == [1], "top-p on the top 2, renormalised: 0.5 / 0.75 >= 0.6"
    assert _mask(probs, top_k=99) == [0, 1, 2, 3, 4], "k past the vocabulary keeps all"


def test_ties_with_the_least_probability_kept_are_kept() -> None:
    probs = [0.0625, 0.5, 0.0625, 0.25, 0.0625, 0.0625]
    assert _mask(probs, top_k=3) == [0, 1, 2, 3, 4, 5], "the third is tied with three more"
    assert _mask(probs, top_p=0.8) == [0, 1, 2, 3, 4, 5], "0.75 < 0.8 needs one of four ties: all four"
    assert _mask([0.25, 0.25, 0.25, 0.25], top_k=1) == [0, 1, 2, 3]


def test_top_p_one_and_top_k_zero_are_no_ops() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 50, generator=gen, dtype=torch.float64) * 4
    logits[0, 0, :10] = -1e4  # probabilities that underflow to 0 are kept too (and never sampled)
    probs = torch.softmax(logits.float(), dim=-1)
    assert bool(keep_mask(probs, torch.ones(4), torch.zeros(4, dtype=torch.long)).all())
    assert bool(keep_mask(probs, torch.ones(4), None).all()) and bool(
        keep_mask(probs, None, torch.zeros(4, dtype=torch.long)).all()
    )
    temperature, seed = torch.tensor([0.7, 1.0, 1.6, 0.0]), torch.tensor([1, 2, 3, 4])
    for draw in range(30):
        draws = torch.full((4,), draw)
        plain = choose_tokens(logits, temperature, seed, draws)
        off = choose_tokens(logits, temperature, seed, draws, True, torch.ones(4), torch.zeros(4, dtype=torch.long))
        assert torch.equal(plain, off), draw


def test_each_row_of_a_batch_has_its_own_settings() -> None:
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(4, 2, 12, generator=gen) * 2, dim=-1)  # [4, 2, 12]
    top_p, top_k = torch.tensor([1.0, 0.5, 0.9, 0.3]), torch.tensor([0, 0, 3, 5])
    mask = keep_mask(probs, top_p, top_k)
    for b in range(4):
        alone = keep_mask(probs[b : b + 1], top_p[b : b + 1], top_k[b : b + 1])[0]
        assert torch.equal(mask[b], alone), b
        expected = processed(probs[b].double().numpy(), float(top_p[b]), int(top_k[b])) > 0
        assert np.array_equal(mask[b].numpy(), expected), b
    assert bool(mask[0].all()) and int(mask[2].sum(-1).max()) <= 3


def test_filters_leave_greedy_rows_alone_and_top_k_one_is_greedy() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 20, generator=gen)
    greedy = logits.argmax(-1)
    temperature = torch.tensor([0.0, 0.9, 1.5])
    top_p, top_k = torch.tensor([0.05, 1.0, 0.99]), torch.tensor([2, 1, 0])
    for draw in range(40):
        out = choose_tokens(logits, temperature, torch.tensor([5, 6, 7]), torch.full((3,), draw), True, top_p, top_k)
        assert torch.equal(out[0], greedy[0]) and torch.equal(out[1], greedy[1]), draw


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.7, 0.8, 0), (1.3, 1.0, 3), (0.8, 0.7, 4)])
def test_choose_tokens_follows_the_processed_distribution(temperature: float, top_p: float, top_k: int) -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0, 0.5, 1.5, -0.5, 0.2])
    draws = 20000
    batch, seed = logits.expand(draws, 1, -1), torch.full((draws,), 7)
    tokens = choose_tokens(
        batch,
        torch.full((draws,), temperature),
        seed,
        torch.arange(draws),
        True,
        torch.full((draws,), top_p),
        torch.full((draws,), top_k),
    )[:, 0]
    counts = np.bincount(tokens.numpy(), minlength=8)
    scaled = torch.softmax(logits.double() / temperature, -1).numpy()
    probs = processed(scaled, top_p, top_k)
    assert counts[probs == 0].sum() == 0, "no filtered token is ever drawn"
    assert pooled_chisquare(counts, probs) > 1e-3
    assert pooled_chisquare(counts, scaled) < 1e-3, "power: the unfiltered distribution is rejected"


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.7, 0.8, 0), (1.5, 1.0, 3)])
def test_tokens_follow_the_targets_processed_distribution(
    method: str, temperature: float, top_p: float, top_k: int
) -> None:
    """The accept walk compares drafts with the target's processed sample at each node: a method's tokens follow
    the target's processed distribution, token after token (joint of the first two, marginal of the third)."""
    target, drafter = tiny_pair(3, vocab=VOCAB, block_size=4)  # a pair whose chain is accepted often
    config = GenerationConfig(
        method=method, budget=12, temperature=temperature, seed=5, max_new_tokens=3, top_p=top_p, top_k=top_k
    )
    out = Engine(target, drafter).generate([PROMPT] * DRAWS, config)
    seqs = np.array([o.token_ids for o in out.outputs])  # [draws, 3]
    if method != "ar":
        accepted = sum(a - 1 for o in out.outputs for a in o.acceptance_lengths)
        assert accepted > DRAWS // 4, "drafts must be accepted for the test to mean anything"

    def joint(p: float, k: int) -> tuple[np.ndarray, np.ndarray]:
        """P(token 1, token 2) `[vocab, vocab]` and P(token 3) `[vocab]`, filtered with `p` and `k`."""
        p1 = processed(target_probs(target, [PROMPT], temperature)[0], p, k)
        p2_given_1 = processed(target_probs(target, [[*PROMPT, a] for a in range(VOCAB)], temperature), p, k)
        joint12 = p1[:, None] * p2_given_1
        pairs = [[*PROMPT, a, b] for a in range(VOCAB) for b in range(VOCAB)]
        p3_given_12 = processed(target_probs(target, pairs, temperature), p, k).reshape(VOCAB, VOCAB, VOCAB)
        return joint12, (joint12[:, :, None] * p3_given_12).sum(axis=(0, 1))

    joint12, p3 = joint(top_p, top_k)
    count12 = np.zeros((VOCAB, VOCAB))
    np.add.at(count12, (seqs[:, 0], seqs[:, 1]), 1)
    count3 = np.bincount(seqs[:, 2], minlength=VOCAB)
    assert count12[joint12 == 0].sum() == 0 and count3[p3 == 0].sum() == 0, "a filtered token was emitted"
    assert pooled_chisquare(count12.ravel(), joint12.ravel()) > 1e-3
    assert pooled_chisquare(count3, p3) > 1e-3
    # Power: the same draws reject the distribution without the filter.
    assert pooled_chisquare(count12.ravel(), joint(1.0, 0)[0].ravel()) < 1e-3


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_greedy_requests_beside_filtered_ones_decode_their_greedy_tokens(method: str) -> None:
    """A T = 0 request ignores its own top-p and top-k, and a batch that filters leaves it as it is alone."""
    target, drafter = tiny_pair(6, vocab=16, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(6, 3, vocab=16)
    greedy = engine.generate(prompts, GenerationConfig(method=method, budget=8, max_new_tokens=16)).outputs
    session = DecodeSession(target, drafter, shape_of(method, 8, None, drafter), slots=3, capacity=128)
    requests = [
        Request(prompts[0], 16, 0.0, top_p=0.1, top_k=2),
        Request(prompts[1], 16, 0.9, seed=4, top_p=0.7, top_k=5),
        Request(prompts[2], 16, 0.0),
    ]
    slots = session.join(requests)
    while session.has_active():
        session.step()
    outs = [session.leave(slot).token_ids for slot in slots]
    assert outs[0] == greedy[0].token_ids and outs[2] == greedy[2].token_ids


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_a_filtered_request_samples_the_same_tokens_alone_batched_or_streamed(method: str) -> None:
    target, drafter = tiny_pair(4, vocab=16, block_size=4)
    engine = Engine(target, drafter)
    cfg = GenerationConfig(method=method, budget=8, temperature=0.9, seed=3, max_new_tokens=16, top_p=0.85, top_k=6)
    prompts = [[1, 2], [5, 6, 7], [3], [9, 9, 4, 2]]
    alone = [engine.generate([p], GenerationConfig(**{**cfg.__dict__, "seed": 3 + i})) for i, p in enumerate(prompts)]
    batched = engine.generate(prompts, cfg).outputs
    streamed = engine.stream(prompts, cfg, slots=2).outputs
    for i, one in enumerate(alone):
        assert one.outputs[0].token_ids == batched[i].token_ids == streamed[i].token_ids, i
    unfiltered = engine.generate(prompts, GenerationConfig(**{**cfg.__dict__, "top_p": 1.0, "top_k": 0})).outputs
    assert [o.token_ids for o in unfiltered] != [o.token_ids for o in batched], "the filter changes some draw"


def test_filter_settings_out_of_range_are_errors_that_speak_of_values() -> None:
    engine = Engine(*tiny_pair(7, vocab=16, block_size=4))
    bad = {
        "top_p": (0.0, "top_p must be in \\(0, 1\\], got 0.0"),
        "top_k": (-1, "top_k must be an integer >= 0 \\(0: off\\), got -1"),
        "logprobs": (21, "logprobs must be None or in \\[0, 20\\], got 21"),
    }
    for name, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            engine.generate([[1, 2]], GenerationConfig(**{name: value}))  # type: ignore[arg-type]
        session = DecodeSession(engine.target, engine.drafter, shape_of("ar", 1, None, None), slots=1, capacity=64)
        with pytest.raises(ValueError, match=message):
            session.join([Request([1, 2], 4, **{name: value})])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.generate([[1]], GenerationConfig(top_p=float("nan")))
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.generate([[1]], GenerationConfig(top_p=1.5))
