"""At T=1, ddtree's tokens follow the target's own distribution (the target samples at every node)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ddtree.engine.engine import Engine
from ddtree.sampling import choose_tokens, counter_uniform
from ddtree.settings import GenerationConfig
from tests.helpers import random_prompts, tiny_pair

VOCAB = 8
PROMPT = [1, 2, 3]
DRAWS = 4000


def target_probs(target: object, prefixes: list[list[int]], temperature: float = 1.0) -> np.ndarray:
    """Exact next-token probabilities at `temperature`, `[len(prefixes), vocab]`, from the HF model itself."""
    model = target.model  # type: ignore[attr-defined]
    with torch.no_grad():
        logits = model(torch.tensor(prefixes, device=model.device)).logits[:, -1].double()
    return torch.softmax(logits / temperature, dim=-1).cpu().numpy()


def pooled_chisquare(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value, cells with expected count < 5 pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep]).pvalue)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_ddtree_samples_the_target_distribution_at_its_temperature(temperature: float) -> None:
    target, drafter = tiny_pair(11, vocab=VOCAB, block_size=4)
    config = GenerationConfig(method="ddtree", budget=12, temperature=temperature, seed=5, max_new_tokens=3)
    out = Engine(target, drafter).generate([PROMPT] * DRAWS, config)
    seqs = np.array([o.token_ids for o in out.outputs])  # [draws, 3]
    accepted = sum(a - 1 for o in out.outputs for a in o.acceptance_lengths)
    assert accepted > DRAWS // 4, "drafts must be accepted for the test to mean anything"

    def joint(t: float) -> tuple[np.ndarray, np.ndarray]:
        """P(token 1, token 2) `[vocab, vocab]` and P(token 3) `[vocab]` at temperature t."""
        p1 = target_probs(target, [PROMPT], t)[0]
        p2_given_1 = target_probs(target, [[*PROMPT, a] for a in range(VOCAB)], t)
        joint12 = p1[:, None] * p2_given_1
        pairs = [[*PROMPT, a, b] for a in range(VOCAB) for b in range(VOCAB)]
        p3_given_12 = target_probs(target, pairs, t).reshape(VOCAB, VOCAB, VOCAB)
        return joint12, (joint12[:, :, None] * p3_given_12).sum(axis=(0, 1))

    joint12, p3 = joint(temperature)
    count12 = np.zeros((VOCAB, VOCAB))
    np.add.at(count12, (seqs[:, 0], seqs[:, 1]), 1)
    count3 = np.bincount(seqs[:, 2], minlength=VOCAB)
    assert pooled_chisquare(count12.ravel(), joint12.ravel()) > 1e-3
    assert pooled_chisquare(count3, p3) > 1e-3
    # The same test has power: the draws are neither uniform nor those of a temperature applied twice or never.
    assert pooled_chisquare(count3, np.full(VOCAB, 1 / VOCAB)) < 1e-3
    for wrong in {temperature * temperature, 1.0} - {temperature}:
        assert pooled_chisquare(count12.ravel(), joint(wrong)[0].ravel()) < 1e-3, wrong


@pytest.mark.parametrize("temperature", [0.5, 0.8, 2.0])
def test_sampling_is_seeded(temperature: float) -> None:
    """A batch of 3 samples the same tokens again with the same seed, in the same engine or a new one."""
    target, drafter = tiny_pair(2, vocab=16, block_size=4)
    engine = Engine(target, drafter)
    prompts = [[1, 2], [3], [4, 5, 6]]
    cfg = GenerationConfig(method="ddtree", budget=8, temperature=temperature, seed=9, max_new_tokens=20)
    a = engine.generate(prompts, cfg)
    b = engine.generate(prompts, cfg)
    fresh = Engine(target, drafter).generate(prompts, cfg)
    c = engine.generate(prompts, GenerationConfig(**{**cfg.__dict__, "seed": 10}))
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs] == [o.token_ids for o in fresh.outputs]
    assert [o.token_ids for o in a.outputs] != [o.token_ids for o in c.outputs]


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_a_small_temperature_decodes_the_greedy_tokens_of_a_batch(method: str) -> None:
    target, drafter = tiny_pair(6, vocab=16, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(6, 3, vocab=16)
    greedy = engine.generate(prompts, GenerationConfig(method=method, budget=8, max_new_tokens=20))
    cold = GenerationConfig(method=method, budget=8, temperature=1e-3, seed=1, max_new_tokens=20)
    assert [o.token_ids for o in engine.generate(prompts, cold).outputs] == [o.token_ids for o in greedy.outputs]


def test_a_request_samples_the_same_tokens_whatever_else_is_in_the_batch() -> None:
    target, drafter = tiny_pair(4, vocab=16, block_size=4)
    engine = Engine(target, drafter)
    cfg = GenerationConfig(method="ddtree", budget=8, temperature=0.9, seed=3, max_new_tokens=16)
    alone = engine.generate([[1, 2]], cfg).outputs[0].token_ids
    batched = engine.generate([[1, 2], [5, 6, 7], [3]], cfg).outputs[0].token_ids
    assert alone == batched


def _draw_counts(logits: torch.Tensor, temperature: float, draws: int) -> np.ndarray:
    """Counts of `draws` tokens drawn from `logits` `[vocab]`, one draw counter each."""
    batch = logits.expand(draws, 1, -1)
    temps = torch.full((draws,), temperature)
    tokens = choose_tokens(batch, temps, torch.full((draws,), 7), torch.arange(draws))[:, 0]
    return np.bincount(tokens.numpy(), minlength=logits.shape[-1])


def test_choose_tokens_is_greedy_at_zero_and_follows_softmax_over_t() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0, 0.5])
    zero = torch.zeros(1)
    assert choose_tokens(logits[None, None], zero, zero.long(), zero.long()).tolist() == [[1]]
    for temperature in (0.5, 1.0, 2.0):
        counts = _draw_counts(logits, temperature, 20000)
        probs = torch.softmax(logits.double() / temperature, -1).numpy()
        assert pooled_chisquare(counts, probs) > 1e-3, temperature
        # Power: the same draws are far from the distribution at another temperature.
        other = torch.softmax(logits.double() / (temperature * 2), -1).numpy()
        assert pooled_chisquare(counts, other) < 1e-3, temperature


def test_small_temperature_approaches_greedy_and_mixed_batches_keep_greedy_rows() -> None:
    logits = torch.tensor([[[0.0, 2.0, 1.0]], [[3.0, 0.0, 1.0]]])  # [2, 1, 3]
    temps = torch.tensor([0.01, 0.0])
    for draw in range(50):
        out = choose_tokens(logits, temps, torch.tensor([1, 2]), torch.tensor([draw, draw]))
        assert out.tolist() == [[1], [0]]


def test_counter_uniform_is_seeded_and_in_range() -> None:
    u = counter_uniform(torch.arange(2000), torch.zeros(2000, dtype=torch.long), 8)  # [2000, 8]
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01
    again = counter_uniform(torch.arange(2000), torch.zeros(2000, dtype=torch.long), 8)
    assert torch.equal(u, again)
    next_draw = counter_uniform(torch.arange(2000), torch.ones(2000, dtype=torch.long), 8)
    assert float((u == next_draw).float().mean()) < 0.01


def test_greedy_choice_reads_16_bit_logits_as_their_float32_values() -> None:
    """The target's head returns logits in its own dtype: argmax over bfloat16 logits, which tie often, picks
    the token that argmax over the same values in float32 picks, and sampling casts before its softmax."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randint(-6, 6, (3, 5, 40), generator=gen).float() / 4).to(torch.bfloat16)  # many ties
    temperature, seed, draw = torch.tensor([0.0, 0.7, 1.3]), torch.tensor([1, 2, 3]), torch.tensor([0, 4, 9])
    for sampled in (False, True):
        half = choose_tokens(logits, temperature, seed, draw, sampled)
        assert torch.equal(half, choose_tokens(logits.float(), temperature, seed, draw, sampled)), sampled
