"""The fused Triton tree build against the torch reference, on CPU under Triton's interpreter."""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np
import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: they run on CPU, in numpy
pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")

import triton
import triton.language as tl

from ddtree.bench.tree_build import time_tree_build
from ddtree.kernels import tree_build
from ddtree.kernels.tree_build import beam_tree, build_tree_fused, fused_supported, triton_available, vocab_topk
from ddtree.tree import DraftTree, build_tree

if not tree_build._interpreting():  # imported earlier without TRITON_INTERPRET: rebuild the kernels
    importlib.reload(sys.modules["ddtree.kernels._tree_build_triton"])
KERNELS = tree_build._kernels()

FIELDS = ("tokens", "parents", "depths", "num_nodes")
RADIX_KNOBS = ("_RADIX_BITS_VOCAB", "_RADIX_BITS_MERGE", "_RADIX_BITS_BEAM")


@pytest.fixture(params=[1, 4], ids=["radix1", "radix4"])
def radix_bits(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Runs a test with the threshold searches of all three kernels at 1 (binary) and 4 bits a round."""
    for knob in RADIX_KNOBS:
        monkeypatch.setattr(tree_build, knob, request.param)
    return int(request.param)


@pytest.fixture(params=[False, True], ids=["chunks", "rows"])
def vocab_rows(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Runs a test with the vocab stage as the partial and merge kernels, then as the row kernel."""
    monkeypatch.setattr(tree_build, "_VOCAB_ROWS", request.param)
    return bool(request.param)


def random_logits(batch: int, depth: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((batch, depth, vocab), generator=gen) * scale  # [batch, depth, vocab]


def assert_same_tree(fused: DraftTree, ref: DraftTree) -> None:
    for field in FIELDS:
        assert torch.equal(getattr(fused, field), getattr(ref, field)), field
    assert fused.log_probs.dtype == torch.float32
    torch.testing.assert_close(fused.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5)


def assert_equivalent_tree(fused: DraftTree, ref: DraftTree, logits: torch.Tensor) -> None:
    """For inputs with ties: the same prefix probabilities, in a valid tree (parents first, distinct prefixes)."""
    assert torch.equal(fused.num_nodes, ref.num_nodes)
    torch.testing.assert_close(fused.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5)
    token_lp = torch.log_softmax(logits.float(), dim=-1)  # [batch, depth, vocab]
    for b in range(fused.batch_size):
        n = int(fused.num_nodes[b])
        nodes = torch.arange(1, n + 1)
        par, dep, tok = fused.parents[b, 1 : n + 1], fused.depths[b, 1 : n + 1], fused.tokens[b, 1 : n + 1]
        assert bool((par < nodes).all()) and torch.equal(dep, fused.depths[b][par] + 1)
        torch.testing.assert_close(fused.log_probs[b, 1 : n + 1], fused.log_probs[b][par] + token_lp[b, dep - 1, tok])
        assert len(set(zip(par.tolist(), tok.tolist(), strict=True))) == n


def test_triton_available_under_the_interpreter() -> None:
    assert triton_available()


@triton.jit
def kth_largest_kernel(
    key_ptr: tl.tensor,  # [N] int32: the bits of uint32 keys
    t_ptr: tl.tensor,  # [N] int32 out: the threshold for k = 1 + program id, as bits
    count_ptr: tl.tensor,  # [N] int32 out: count(key >= threshold)
    N: tl.constexpr,
    TOP_BIT: tl.constexpr,
    RADIX_BITS: tl.constexpr,
) -> None:
    """Program k - 1 runs the threshold search of `_compact_top` for k over all N keys."""
    ukey = tl.load(key_ptr + tl.arange(0, N)).to(tl.uint32, bitcast=True)
    k = tl.program_id(0) + 1
    if RADIX_BITS == 1:
        t, count = KERNELS._kth_largest(ukey, k, TOP_BIT)
    else:
        t, count = KERNELS._kth_largest_radix(ukey, k, TOP_BIT, RADIX_BITS)
    tl.store(t_ptr + k - 1, t.to(tl.int32, bitcast=True))
    tl.store(count_ptr + k - 1, count)


@pytest.mark.parametrize("top_bit", [31, 18, 15])  # float32 keys, float16 (LOW_BITS 13), bfloat16 (16)
@pytest.mark.parametrize("radix", [1, 3, 4])  # partial top rounds: 3 bits at top bit 31 (wrapping), 18; 4 at 18
def test_threshold_search_finds_the_kth_largest_key(top_bit: int, radix: int) -> None:
    """For every k: count = #(key >= t) >= k, and t is the k-th largest key unless count == k exactly (then
    `key >= t` selects the k largest whatever t is). That pins the count, so every search returns the same."""
    n, rng = 32, np.random.default_rng(top_bit * 10 + radix)
    top = 2 ** (top_bit + 1) - 1
    pool = np.array([0, 1, top, top - 1, 2**top_bit, rng.integers(0, top)], dtype=np.int64)
    keys = np.concatenate([rng.choice(pool, n // 2), rng.integers(0, top, n // 2, endpoint=True)])  # ties
    t, count = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    key_bits = torch.from_numpy(keys.astype(np.uint32).view(np.int32))
    kth_largest_kernel[(n,)](key_bits, t, count, N=n, TOP_BIT=top_bit, RADIX_BITS=radix)
    t_np, ordered = t.numpy().view(np.uint32).astype(np.int64), np.sort(keys)[::-1]
    for k in range(1, n + 1):
        assert count[k - 1] == (keys >= t_np[k - 1]).sum() >= k, k
        assert count[k - 1] == k or t_np[k - 1] == ordered[k - 1], k


@pytest.mark.parametrize(
    ("batch", "depth", "vocab", "budget", "topk"),
    [
        (2, 4, 300, 16, None),  # topk defaults to the budget
        (3, 5, 1000, 32, 4),  # topk < budget
        (2, 3, 200, 8, 1),  # topk 1: a chain
        (2, 3, 50, 1, None),  # budget 1
        (2, 3, 4, 100, None),  # budget > the 4 + 16 + 64 possible prefixes
        (1, 2, 3, 64, 2),  # budget > 2 + 4 possible prefixes
        (2, 4, 777, 16, 40),  # topk > budget; vocab not a power of two
        (2, 1, 100, 8, None),  # depth 1
    ],
)
def test_matches_build_tree(
    batch: int, depth: int, vocab: int, budget: int, topk: int | None, radix_bits: int, vocab_rows: bool
) -> None:
    logits = random_logits(batch, depth, vocab, seed=batch * 1000 + vocab + budget)
    assert_same_tree(build_tree_fused(logits, budget, topk), build_tree(logits, budget, topk))


@pytest.mark.parametrize(("budget", "topk"), [(2, 1), (3, 3), (7, 2), (33, 5), (64, 16), (64, 64)])
def test_beam_tree_over_budgets(budget: int, topk: int, radix_bits: int) -> None:
    """The beam kernel alone, on torch's own top-k lists: budgets up to 64 (M_PAD 512), k below and at the budget."""
    logits = random_logits(2, 4, 80, seed=budget * 100 + topk)
    top_lp, top_ids = torch.topk(torch.log_softmax(logits, dim=-1), topk, dim=-1)  # [2, 4, topk]
    assert_same_tree(beam_tree(top_lp, top_ids, budget), build_tree(logits, budget, topk))


def test_many_vocab_chunks(monkeypatch: pytest.MonkeyPatch, radix_bits: int) -> None:
    """Small chunks: the split-K logsumexp and top-k merge over 7 chunks, the last one partial."""
    monkeypatch.setattr(tree_build, "_CHUNK", 64)
    logits = random_logits(2, 3, 400, seed=5)  # 400 = 6 * 64 + 16
    assert tree_build._chunk_plan(400, 16) == (64, 7)
    assert_same_tree(build_tree_fused(logits, 16), build_tree(logits, 16))


@pytest.mark.parametrize(("vocab", "k"), [(1000, 1), (1000, 37), (200, 128), (64, 64)])
def test_vocab_topk_matches_log_softmax_topk(vocab: int, k: int, radix_bits: int, vocab_rows: bool) -> None:
    logits = random_logits(2, 3, vocab, seed=vocab + k)
    top_lp, top_ids = vocab_topk(logits, k)
    ref_lp, ref_ids = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)
    assert top_lp.shape == (2, 3, k) and top_lp.dtype == torch.float32 and top_ids.dtype == torch.int64
    assert torch.equal(top_ids, ref_ids)
    torch.testing.assert_close(top_lp, ref_lp, rtol=1e-6, atol=1e-6)


def test_low_precision_logits_are_read_as_float32(radix_bits: int, vocab_rows: bool) -> None:
    """bfloat16 and float16 logits without ties (distinct multiples of 1/8) give torch's top-k and tree."""
    perm = torch.stack([torch.randperm(256, generator=torch.Generator().manual_seed(s)) for s in range(4)])
    logits = (perm.reshape(2, 2, 256).float() / 8 - 16).to(torch.bfloat16)  # [2, 2, 256]
    for dtype in (torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        top_lp, top_ids = vocab_topk(x, 8)
        ref_lp, ref_ids = torch.topk(torch.log_softmax(x.float(), dim=-1), 8, dim=-1)
        assert torch.equal(top_ids, ref_ids)
        torch.testing.assert_close(top_lp, ref_lp)
        # Sums of values on a 1/8 grid tie often across depths: compare up to ties.
        assert_equivalent_tree(build_tree_fused(x, 16), build_tree(x, 16), x)


def test_by_default_16_bit_logits_take_the_row_kernel_and_float32_the_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`_VOCAB_ROWS = None` picks the vocab stage by the logits' dtype, as the H200 timings chose."""
    monkeypatch.setattr(tree_build, "_VOCAB_ROWS", None)
    seen: list[torch.dtype] = []
    rows = tree_build._vocab_topk_rows

    def spy(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(logits.dtype)
        return rows(logits, k)

    monkeypatch.setattr(tree_build, "_vocab_topk_rows", spy)
    logits = torch.randn(1, 2, 300)  # [1, 2, 300]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype).float()
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :4]  # ties: smaller id first
        assert torch.equal(vocab_topk(logits.to(dtype), 4)[1], order)
    assert seen == [torch.bfloat16, torch.float16]


def test_ties_prefer_smaller_token_ids_and_keep_a_valid_tree(radix_bits: int, vocab_rows: bool) -> None:
    logits = torch.zeros((2, 3, 40))  # every token ties
    logits[1, :, 7] = 1.0
    _, top_ids = vocab_topk(logits, 5)
    assert top_ids[0].tolist() == [[0, 1, 2, 3, 4]] * 3
    assert top_ids[1].tolist() == [[7, 0, 1, 2, 3]] * 3
    fused = build_tree_fused(logits, 12)
    assert fused.tokens[0, 1:6].tolist() == [0, 1, 2, 3, 4]  # the depth-1 nodes come first among equals
    assert_equivalent_tree(fused, build_tree(logits, 12), logits)


def test_minus_inf_logits_make_fewer_nodes(radix_bits: int, vocab_rows: bool) -> None:
    logits = random_logits(2, 3, 20, seed=3)
    logits[0, :, 2:] = float("-inf")  # request 0 has 2 + 4 + 8 finite prefixes
    fused, ref = build_tree_fused(logits, 32), build_tree(logits, 32)
    assert fused.num_nodes.tolist() == [14, 32]
    assert_same_tree(fused, ref)


@pytest.mark.parametrize("cap", [None, 1], ids=["floor", "slow-path"])
def test_the_row_kernel_keeps_ties_in_vocab_order_on_both_of_its_paths(
    cap: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logits on three levels tie across the k-th place: the candidates at or above the floor (about a third
    of the vocabulary), or, with the candidate room at its minimum (4 * K_PAD), the exact search's, give the
    top k by (log-prob descending, vocab id ascending), as a stable sort does."""
    monkeypatch.setattr(tree_build, "_VOCAB_ROWS", True)
    if cap is not None:
        monkeypatch.setattr(tree_build, "_ROW_CAP", cap)
    gen = torch.Generator().manual_seed(21)
    logits = torch.randint(0, 3, (2, 2, 2000), generator=gen).float()  # [2, 2, 2000]
    k = 37
    assert tree_build._row_plan(2000, 64)[3] == (2048 if cap is None else 256), "the slow path needs > CAP"
    top_lp, top_ids = vocab_topk(logits, k)
    ref_lp = torch.log_softmax(logits, dim=-1)
    order = torch.sort(ref_lp, dim=-1, descending=True, stable=True).indices[..., :k]  # ties: smaller id first
    assert torch.equal(top_ids, order)
    torch.testing.assert_close(top_lp, ref_lp.gather(-1, order), rtol=1e-6, atol=1e-6)


def test_the_row_plan_samples_at_least_k_stretches_within_the_block_limit() -> None:
    for vocab, k_pad in ((49152, 256), (49152, 16), (200, 128), (3, 2), (1 << 20, 256)):
        tile, group, s_pad, cap = tree_build._row_plan(vocab, k_pad)
        assert -(-vocab // group) >= k_pad and s_pad <= tree_build.MAX_BLOCK and tile % group == 0, vocab
        assert 4 * k_pad <= cap <= tree_build.MAX_BLOCK


def test_sizes_past_the_kernel_limits_fall_back_to_build_tree() -> None:
    assert fused_supported(15, 49152, 256, 256)
    assert not fused_supported(2, 10, 20000, 10)
    logits = random_logits(1, 2, 10, seed=4)
    assert_same_tree(build_tree_fused(logits, 20000), build_tree(logits, 20000))


def test_rejects_what_build_tree_rejects() -> None:
    """Logits of the wrong rank; the budget and top-k are the settings' to check (`ddtree.settings`)."""
    for fn in (build_tree, build_tree_fused):
        with pytest.raises(ValueError, match="must be"):
            fn(torch.zeros(2, 50), 4, None)


def test_time_tree_build_on_cpu_times_the_torch_path_only() -> None:
    result = time_tree_build("cpu", batch=2, depth=3, vocab=100, budget=8, repeats=2)
    assert set(result) == {"torch_ms"} and result["torch_ms"] > 0


@pytest.mark.parametrize(("batch", "depth", "vocab", "budget", "topk"), [(2, 4, 300, 16, None), (2, 3, 4, 100, 3)])
def test_bitonic_selection_matches_too(
    monkeypatch: pytest.MonkeyPatch, batch: int, depth: int, vocab: int, budget: int, topk: int | None
) -> None:
    """The other selection of the merge and beam kernels: one tl.topk instead of threshold search + sort."""
    monkeypatch.setattr(tree_build, "_BITONIC_MERGE", True)
    monkeypatch.setattr(tree_build, "_BITONIC_BEAM", True)
    logits = random_logits(batch, depth, vocab, seed=11)
    assert_same_tree(build_tree_fused(logits, budget, topk), build_tree(logits, budget, topk))


@pytest.mark.parametrize("budget", [3, 16])
def test_engine_with_the_fused_tree_kernel_equals_ar(budget: int) -> None:
    """The decode loop with the fused kernels (interpreted here) stays lossless and builds the torch path's trees."""
    from ddtree.engine.engine import Engine
    from ddtree.settings import GenerationConfig
    from tests.helpers import random_prompts, tiny_pair

    target, drafter = tiny_pair(21, vocab=24, block_size=5, dtype=torch.float32)
    prompts = random_prompts(21, 3, vocab=24)
    ar = Engine(target, drafter).generate(prompts, GenerationConfig(method="ar", max_new_tokens=16))
    config = GenerationConfig(method="ddtree", budget=budget, max_new_tokens=16)
    fused = Engine(target, drafter, tree_kernel="triton").generate(prompts, config)
    plain = Engine(target, drafter).generate(prompts, config)
    assert [o.token_ids for o in fused.outputs] == [o.token_ids for o in ar.outputs]
    assert [o.acceptance_lengths for o in fused.outputs] == [o.acceptance_lengths for o in plain.outputs]


def test_beam_radix_picks_by_budget_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_build, "_RADIX_BITS_BEAM", None)
    assert [tree_build._beam_radix(b) for b in (32, 64, 128, 256)] == [4, 4, 1, 1]
    monkeypatch.setattr(tree_build, "_RADIX_BITS_BEAM", 1)
    assert tree_build._beam_radix(32) == 1
