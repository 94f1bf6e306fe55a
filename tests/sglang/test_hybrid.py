"""DDTREE on gated-delta-net (GDN) hybrid targets in the real SGLang 0.5.23 Engine on CPU (DDTREE_SGLANG_CPU=1,
float32) against our engine: tiny random Qwen3.5 and Qwen3-Next targets (`letter_pair`), a ragged batch of three
prompts.

SGLang runs its own linear-attention backend in tree mode, with CPU stand-ins for its Triton kernels
(`ddtree.sglang.cpu_gdn`, and for Qwen3-Next's mixture of experts the shared expert's gate,
`ddtree.sglang.cpu_moe`); the radix cache is off (its state tracking is GPU-only) and the convolution windows
are kept in float32 (SGLang's default is bfloat16, which our float32 engine would not match).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.letter_pair import KINDS, write_letter_pair
from tests.sglang.support import Run, assert_same_runs, ddtree_runs, requires_sglang, sglang_runs, trimmed

pytestmark = requires_sglang

PROMPTS = [[1, 2, 3, 4, 5], [3, 2, 1], [0, 1]]
ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}
ENGINE = {"disable_radix_cache": True}
# (budget, top-k): trees three and one-and-a-half times the drafter's block (8), the second with siblings
# limited to two a node.
TREES = [(24, None), (12, 2)]


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A target of each kind (Qwen3.5, Qwen3-Next) and its drafter."""
    return write_letter_pair(tmp_path_factory.mktemp(request.param), kind=request.param)


def _sglang(pair: tuple[Path, Path], algorithm: str, env: dict[str, str]) -> list[Run]:
    return sglang_runs(algorithm, PROMPTS, ENV | env, target=str(pair[0]), drafter=str(pair[1]), engine=ENGINE)


@pytest.mark.parametrize(("budget", "topk"), TREES)
def test_ddtree_on_a_gdn_target_matches_our_engine(pair: tuple[Path, Path], budget: int, topk: int | None) -> None:
    env = {"SGLANG_DDTREE_BUDGET": str(budget)} | ({"SGLANG_DDTREE_TOPK": str(topk)} if topk is not None else {})
    theirs = _sglang(pair, "DDTREE", env)
    assert_same_runs(ddtree_runs("ddtree", PROMPTS, budget, topk, pair), theirs)
    assert any(len(trimmed(r.histogram)) > 2 for r in theirs), "no step accepted two drafts: the tree did little"


def test_plain_decoding_of_the_gdn_target_is_ours(pair: tuple[Path, Path]) -> None:
    """SGLang without speculation (its prefill and decode kernels, here the CPU stand-ins) is our `ar`."""
    theirs = _sglang(pair, "NONE", {})
    assert [r.token_ids for r in theirs] == [r.token_ids for r in ddtree_runs("ar", PROMPTS, pair=pair)]
