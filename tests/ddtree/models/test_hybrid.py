"""Hybrid targets (gated delta-net with gated attention: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE; Mamba2 with
attention: Bamba) in
our layer loop: our `ar` is transformers' own greedy decode of the model, and greedy dflash and ddtree are our
`ar`, token for token, on trees of every budget and top-k, ragged batches and requests that join and leave;
sampled ddtree follows the target's distribution."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree.cli.main import main
from ddtree.engine.engine import Engine
from ddtree.models.hybrid import HybridTarget
from ddtree.models.pair import load_models
from ddtree.models.target import read_target_config
from ddtree.models.tiny import tiny_hybrid_config, write_tiny_target
from ddtree.settings import GenerationConfig
from tests.ddtree.test_sampling import pooled_chisquare, target_probs
from tests.helpers import random_prompts, tiny_hybrid_pair

KINDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "bamba")
VOCAB = 8  # a small vocabulary: the random drafter's guesses are often the target's, so paths get long


@pytest.mark.parametrize("kind", KINDS)
def test_our_ar_is_transformers_greedy_decode(kind: str) -> None:
    target, _ = tiny_hybrid_pair(kind, 0, vocab=24)
    assert isinstance(target, HybridTarget) and target.recurrent_layers and target.attention_layers
    prompts = random_prompts(1, 3, vocab=24, low=1, high=9)  # ragged: the prefill pads the shorter ones
    ours = Engine(target).generate(prompts, GenerationConfig(method="ar", max_new_tokens=12)).outputs
    for prompt, out in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt], device=target.device)
        hf = target.model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.token_ids == hf[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_long_accepted_paths_are_ar(kind: str) -> None:
    """Four tokens: a tree of 64 nodes holds every path three deep, so steps accept past the convolution's
    window (4) and the commit's states come from the path alone."""
    target, drafter = tiny_hybrid_pair(kind, 2, vocab=4, block_size=6)
    engine = Engine(target, drafter)
    prompts = random_prompts(2, 3, vocab=4)
    ar = engine.generate(prompts, GenerationConfig(method="ar", max_new_tokens=30)).outputs
    out = engine.generate(prompts, GenerationConfig(method="ddtree", budget=64, max_new_tokens=30)).outputs
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]
    assert max(a for o in out for a in o.acceptance_lengths) >= 5


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 4),
    budget=st.integers(1, 40),
    topk=st.one_of(st.none(), st.integers(1, 4)),
)
def test_greedy_ddtree_and_dflash_equal_ar(kind: str, seed: int, batch: int, budget: int, topk: int | None) -> None:
    target, drafter = tiny_hybrid_pair(kind, seed % 5, vocab=VOCAB, block_size=3 + seed % 5)
    engine = Engine(target, drafter)
    prompts = random_prompts(seed, batch, vocab=VOCAB, low=1, high=10)
    new = 6 + seed % 13
    ar = engine.generate(prompts, GenerationConfig(method="ar", max_new_tokens=new)).outputs
    tree = GenerationConfig(method="ddtree", budget=budget, topk=topk, max_new_tokens=new)
    assert [o.token_ids for o in engine.generate(prompts, tree).outputs] == [o.token_ids for o in ar]
    chain = engine.generate(prompts, GenerationConfig(method="dflash", max_new_tokens=new)).outputs
    assert [o.token_ids for o in chain] == [o.token_ids for o in ar]


@pytest.mark.parametrize("kind", KINDS)
def test_requests_joining_and_leaving_decode_as_alone(kind: str) -> None:
    """Continuous batching: a slot's states are its request's, whoever held the slot before."""
    target, drafter = tiny_hybrid_pair(kind, 3, vocab=VOCAB)
    engine = Engine(target, drafter)
    prompts = random_prompts(3, 7, vocab=VOCAB)
    ar = engine.generate(prompts, GenerationConfig(method="ar", max_new_tokens=14)).outputs
    for method in ("ar", "dflash", "ddtree"):
        config = GenerationConfig(method=method, budget=10, max_new_tokens=14)
        out = engine.stream(prompts, config, slots=3).outputs
        assert [o.token_ids for o in out] == [o.token_ids for o in ar], method


GDN_KERNELS = ("gdn_tree", "tree_delta_rule_fused", "commit_delta_fused")
SSM_KERNELS = ("ssm_tree", "tree_ssm_fused", "commit_ssm_fused")


@pytest.mark.parametrize(
    ("kind", "kernels"),
    [("qwen3_next", GDN_KERNELS), ("qwen3_5", GDN_KERNELS), ("qwen3_5_moe", GDN_KERNELS), ("bamba", SSM_KERNELS)],
)
def test_the_triton_state_kernels_decode_as_ar(
    kind: str, kernels: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the triton attention the recurrent layers' tree steps and commits are Triton kernels too (on CPU in
    Triton's interpreter); greedy dflash and ddtree through them still equal `ar`."""
    pytest.importorskip("triton")
    module = importlib.import_module(f"ddtree.kernels.{kernels[0]}")
    calls = {"tree": 0, "commit": 0}
    for name, key in zip(kernels[1:], ("tree", "commit"), strict=True):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _real=real, _key=key: (calls.__setitem__(_key, calls[_key] + 1), _real(*a))[1]
        )
    target, drafter = tiny_hybrid_pair(kind, 4, vocab=VOCAB, block_size=5, dtype=torch.float32)
    prompts = random_prompts(4, 3, vocab=VOCAB, low=1, high=9)
    ar = Engine(target, drafter, attention="sdpa").generate(prompts, GenerationConfig(method="ar", max_new_tokens=12))
    fused = Engine(target, drafter, attention="triton")
    for method, budget in (("dflash", 1), ("ddtree", 12)):
        out = fused.generate(prompts, GenerationConfig(method=method, budget=budget, max_new_tokens=12)).outputs
        assert [o.token_ids for o in out] == [o.token_ids for o in ar.outputs], method
    assert calls["tree"] > 0 and calls["commit"] > 0


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_ddtree_follows_the_hybrid_targets_distribution(kind: str) -> None:
    target, drafter = tiny_hybrid_pair(kind, 11, vocab=VOCAB, block_size=4)
    prompt, draws = [1, 2, 3], 3000
    config = GenerationConfig(method="ddtree", budget=12, temperature=1.0, seed=5, max_new_tokens=2)
    out = Engine(target, drafter).generate([prompt] * draws, config).outputs
    assert sum(a - 1 for o in out for a in o.acceptance_lengths) > draws // 4, "drafts must be accepted"
    p1 = target_probs(target, [prompt])[0]
    joint = p1[:, None] * target_probs(target, [[*prompt, a] for a in range(VOCAB)])  # [vocab, vocab]
    counts = np.zeros((VOCAB, VOCAB))
    seqs = np.array([o.token_ids for o in out])
    np.add.at(counts, (seqs[:, 0], seqs[:, 1]), 1)
    assert pooled_chisquare(counts.ravel(), joint.ravel()) > 1e-3
    assert pooled_chisquare(counts.ravel(), np.full(VOCAB * VOCAB, 1 / VOCAB**2)) < 1e-3, "the test has power"


@pytest.mark.parametrize("kind", KINDS)
def test_a_hybrid_directory_loads_and_gets_a_drafter(kind: str, tmp_path: Path) -> None:
    """From disk, as users have them: `drafter init` sizes a drafter to the hybrid (its feature layers may
    be gated delta-net layers), and the loaded pair decodes as ar."""
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    write_tiny_target(target_dir, seed=4, hidden_size=32, num_layers=4, hybrid=kind)
    assert main(["drafter", "init", "--model", str(target_dir), "--out", str(drafter_dir), "--num-features", "3"]) == 0
    target, drafter, _ = load_models(str(target_dir), str(drafter_dir), "cpu", "float32")
    assert isinstance(target, HybridTarget) and drafter is not None
    assert set(drafter.target_layer_ids) & set(target.recurrent_layers), "a feature layer is a recurrent layer"
    engine = Engine(target, drafter)
    prompts = random_prompts(4, 2, vocab=200)
    ar = engine.generate(prompts, GenerationConfig(method="ar", max_new_tokens=10)).outputs
    out = engine.generate(prompts, GenerationConfig(method="ddtree", budget=16, max_new_tokens=10)).outputs
    assert [o.token_ids for o in out] == [o.token_ids for o in ar]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_a_vision_language_checkpoint_runs_its_text_model(kind: str, tmp_path: Path) -> None:
    """Qwen3.5 ships as vision-language checkpoints (`qwen3_5`, `qwen3_5_moe`, the text model's config under
    `text_config`): the target is its text model, and our `ar` is the whole model's greedy decode of text."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = tiny_hybrid_config(kind, 40, hidden_size=32, num_layers=4)
    wrapper = AutoConfig.for_model(
        kind,
        text_config=text.to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32),
    )
    torch.manual_seed(5)
    whole = AutoModelForImageTextToText.from_config(wrapper).eval()
    for param in whole.parameters():
        if param.dim() > 1:
            torch.nn.init.normal_(param, std=0.2)
    whole.save_pretrained(tmp_path / "target")
    assert read_target_config(tmp_path / "target").model_type == f"{kind}_text"
    target, _, _ = load_models(str(tmp_path / "target"), None, "cpu", "float32")
    assert isinstance(target, HybridTarget)
    prompts = random_prompts(6, 2, vocab=40)
    ours = Engine(target).generate(prompts, GenerationConfig(method="ar", max_new_tokens=10)).outputs
    for prompt, out in zip(prompts, ours, strict=True):
        ref = whole.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert out.token_ids == ref[0, len(prompt) :].tolist()
