"""Greedy dflash and ddtree must reproduce ar token for token, whatever the drafter proposes."""

from __future__ import annotations

import pytest

from ddtree.engine.engine import Engine
from ddtree.settings import GenerationConfig
from tests.helpers import random_prompts, tiny_pair

BUDGETS = [1, 2, 3, 5, 8, 13, 21, 32, 48, 64]


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_ddtree_and_dflash_equal_ar(seed: int, batch: int) -> None:
    target, drafter = tiny_pair(seed, vocab=24, block_size=4 + seed % 5)
    engine = Engine(target, drafter)
    prompts = random_prompts(seed, batch, vocab=24)
    new = 20 + seed
    ar = engine.generate(prompts, GenerationConfig(method="ar", max_new_tokens=new))
    assert all(len(o.token_ids) == new for o in ar.outputs)
    dflash = engine.generate(prompts, GenerationConfig(method="dflash", max_new_tokens=new))
    assert [o.token_ids for o in dflash.outputs] == [o.token_ids for o in ar.outputs]
    accepted_some = False
    for budget in (BUDGETS[seed % len(BUDGETS)], BUDGETS[-1 - seed % len(BUDGETS)]):
        tree = engine.generate(prompts, GenerationConfig(method="ddtree", budget=budget, max_new_tokens=new))
        assert [o.token_ids for o in tree.outputs] == [o.token_ids for o in ar.outputs], f"budget {budget}"
        accepted_some |= any(a > 1 for o in tree.outputs for a in o.acceptance_lengths)
        for o in tree.outputs:
            assert sum(o.acceptance_lengths) + 1 >= len(o.token_ids)
    assert accepted_some, "the test should exercise accepted drafts"


def test_ddtree_with_topk_and_all_budgets_equals_ar() -> None:
    target, drafter = tiny_pair(123, vocab=16, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(5, 4, vocab=16)
    ar = engine.generate(prompts, GenerationConfig(method="ar", max_new_tokens=24))
    for budget in range(1, 65, 7):
        for topk in (1, 2, 16):
            out = engine.generate(
                prompts, GenerationConfig(method="ddtree", budget=budget, topk=topk, max_new_tokens=24)
            )
            assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ar.outputs], (budget, topk)


def test_tree_beats_chain_on_steps_when_drafts_are_likely() -> None:
    """Not a speed claim: with a larger budget, fewer verify steps are needed for the same tokens."""
    target, drafter = tiny_pair(7, vocab=8, block_size=6)
    engine = Engine(target, drafter)
    prompts = random_prompts(1, 4, vocab=8)
    chain = engine.generate(prompts, GenerationConfig(method="dflash", max_new_tokens=40))
    tree = engine.generate(prompts, GenerationConfig(method="ddtree", budget=64, max_new_tokens=40))
    assert tree.steps < chain.steps


def test_eos_stops_each_request_and_the_rest_continue() -> None:
    target, drafter = tiny_pair(3, vocab=24, block_size=5)
    engine = Engine(target, drafter)
    prompts = random_prompts(3, 4, vocab=24)
    ar = engine.generate(prompts, GenerationConfig(method="ar", max_new_tokens=30))
    stop = ar.outputs[0].token_ids[5]
    cfg = GenerationConfig(method="ddtree", budget=16, max_new_tokens=30, eos_token_ids=(stop,))
    out = engine.generate(prompts, cfg)
    for got, full in zip(out.outputs, ar.outputs, strict=True):
        cut = full.token_ids.index(stop) + 1 if stop in full.token_ids else len(full.token_ids)
        assert got.token_ids == full.token_ids[:cut]
