"""At a temperature above 0, DDTREE in the real SGLang 0.5.23 Engine (CPU mode, float32) draws the target's own
distribution: the tokens of many requests for one prompt, against the exact probabilities of the tiny target
(`letter_pair`: a dense Llama and a gated-delta-net Qwen3.5, whose recurrent states are committed along each
sampled path).

SGLang samples the first token with its own sampler; DDTREE's verify samples the target's token at every tree
node and walks them down the tree, so the later tokens are ours, and with four new tokens most requests take a
second verify step after a commit. The draws are not seeded (SGLang batches requests as they arrive), so a
correct run fails a check with probability about `P_MIN`.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.ddtree.test_sampling import pooled_chisquare
from tests.sglang.letter_pair import DENSE, write_letter_pair
from tests.sglang.support import Run, requires_sglang, sglang_runs

pytestmark = requires_sglang

PROMPT = [1, 2, 3]
DRAWS = 3000
NEW_TOKENS = 4
TEMPERATURE = 0.7
P_MIN = 1e-4
ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32", "SGLANG_DDTREE_BUDGET": "12"}
ENGINE = {"disable_radix_cache": True, "max_running_requests": 64}


def exact_joints(target: Path, temperature: float, depth: int) -> list[np.ndarray]:
    """P(t_1, ..., t_k) after `PROMPT` at `temperature`, `[vocab] * k`, for k = 1 .. `depth`, from the HF model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    vocab = model.config.vocab_size
    joints = [np.ones(())]
    for k in range(depth):
        prefixes = [[*PROMPT, *tail] for tail in itertools.product(range(vocab), repeat=k)]
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1]
        cond = torch.softmax(logits / temperature, dim=-1).numpy().reshape([vocab] * (k + 1))
        joints.append(joints[-1][..., None] * cond)
    return joints[1:]


@pytest.fixture(scope="module", params=[DENSE, "qwen3_5"])
def drawn(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Run]]:
    """The target of each kind and DDTREE's runs of `DRAWS` requests for `PROMPT` at `TEMPERATURE`."""
    target, drafter = write_letter_pair(tmp_path_factory.mktemp(request.param), seed=4, kind=request.param)
    sampling = {"temperature": TEMPERATURE, "ignore_eos": True}
    runs = sglang_runs(
        "DDTREE",
        [PROMPT] * DRAWS,
        ENV,
        target=str(target),
        drafter=str(drafter),
        engine=ENGINE,
        max_new_tokens=NEW_TOKENS,
        sampling=sampling,
    )
    return target, runs


def test_ddtree_in_sglang_draws_the_targets_distribution(drawn: tuple[Path, list[Run]]) -> None:
    target, runs = drawn
    tokens = np.array([r.token_ids for r in runs])  # [draws, NEW_TOKENS]
    assert tokens.shape == (DRAWS, NEW_TOKENS)
    accepted = sum(i * n for r in runs for i, n in enumerate(r.histogram))
    assert accepted > DRAWS // 4, "drafts must be accepted for the test to mean anything"
    vocab = exact_joints(target, TEMPERATURE, 1)[0].size

    def counts(*positions: int) -> np.ndarray:
        out = np.zeros([vocab] * len(positions))
        np.add.at(out, tuple(tokens[:, p] for p in positions), 1)
        return out.ravel()

    joints = exact_joints(target, TEMPERATURE, NEW_TOKENS)
    pair = counts(0, 1)
    assert pooled_chisquare(pair, joints[1].ravel()) > P_MIN  # the first token is SGLang's, the second ours
    for k in (2, 3):  # the third and fourth tokens' marginals, the fourth mostly after a state commit
        marginal = joints[k].sum(axis=tuple(range(k)))
        assert pooled_chisquare(counts(k), marginal) > P_MIN, f"token {k + 1}"
    # The same checks have power: the draws are neither uniform nor those of a temperature applied twice or never.
    assert pooled_chisquare(counts(3), np.full(vocab, 1 / vocab)) < P_MIN
    for wrong in (TEMPERATURE * TEMPERATURE, 1.0):
        assert pooled_chisquare(pair, exact_joints(target, wrong, 2)[1].ravel()) < P_MIN, wrong
