"""The real SGLang 0.5.23 Engine on CPU (DDTREE_SGLANG_CPU=1), float32, on the default pair, against our engine.

Each case starts a fresh Engine (about a minute on two cores): DDTREE's settings are read once per process.
A batch of four chat prompts of different lengths, greedy, 32 new tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ddtree.data import heldout_prompts
from ddtree.models.chat import chat_ids
from ddtree.models.default import default_target
from tests.sglang.support import Run, assert_same_runs, ddtree_runs, requires_sglang, sglang_runs

pytestmark = requires_sglang

# (budget, top-k): below the block (16 slots), above it (the window outgrows DFlash's reservation), and
# top-k 1 at budget 32, a chain of 15 nodes padded to 33 slots.
TREES = [(8, None), (32, None), (32, 1)]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_target(quiet=True)))
    by_length: dict[int, list[int]] = {}
    for text in heldout_prompts():
        ids = chat_ids(tokenizer, text)
        by_length.setdefault(len(ids), ids)
    return list(by_length.values())[:4]  # four held-out prompts of four lengths


@pytest.fixture(scope="module")
def sglang_cache() -> dict[tuple[object, ...], list[Run]]:
    return {}


@pytest.fixture
def sglang(prompts: list[list[int]], sglang_cache: dict[tuple[object, ...], list[Run]]) -> Callable[..., list[Run]]:
    """SGLang's runs for an algorithm (and DDTREE's budget and top-k), each configuration started once."""

    def run(algorithm: str, budget: int | None = None, topk: int | None = None) -> list[Run]:
        key = (algorithm, budget, topk)
        if key not in sglang_cache:
            env = {"SGLANG_DDTREE_BUDGET": str(budget)} if budget is not None else {}
            env |= {"SGLANG_DDTREE_TOPK": str(topk)} if topk is not None else {}
            sglang_cache[key] = sglang_runs(algorithm, prompts, env)
        return sglang_cache[key]

    return run


@pytest.mark.parametrize(("budget", "topk"), TREES)
def test_ddtree_in_sglang_matches_our_engine(
    sglang: Callable[..., list[Run]], prompts: list[list[int]], budget: int, topk: int | None
) -> None:
    theirs = sglang("DDTREE", budget, topk)
    assert_same_runs(ddtree_runs("ddtree", prompts, budget, topk), theirs)
    assert any(len(h) > 2 for h in (r.histogram for r in theirs)), "no step accepted two drafts: a trivial tree"


def test_dflash_in_sglang_matches_our_engine(sglang: Callable[..., list[Run]], prompts: list[list[int]]) -> None:
    assert_same_runs(ddtree_runs("dflash", prompts), sglang("DFLASH"))


def test_greedy_ddtree_equals_sglang_plain_decoding(sglang: Callable[..., list[Run]]) -> None:
    plain = sglang("NONE")
    tree = sglang("DDTREE", *TREES[0])
    assert [r.token_ids for r in tree] == [r.token_ids for r in plain]
    assert all(r.steps == 0 for r in plain)
    assert sum(r.steps for r in tree) < sum(len(r.token_ids) for r in tree), "the tree saved no step"
