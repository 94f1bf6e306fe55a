"""The Triton tree attention against torch's attention given the dense tree mask.

On CPU the kernel runs in Triton's interpreter; with DDTREE_TEST_DEVICE=cuda the same tests run on the GPU
(and add bfloat16, which the interpreter cannot compute).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton", reason="triton is not installed (it is in the dev extra)")

from ddtree.kernels.tree_attention import block_sizes, resolve_attention, tree_attention, triton_attention_available
from ddtree.models.target import tree_attention_mask

DEVICE = torch.device(os.environ.get("DDTREE_TEST_DEVICE", "cpu"))
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def random_case(
    batch: int, heads: int, kv_heads: int, n: int, dim: int, capacity: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    """q, keys, values, lengths and a visible matrix (random, with each node seeing itself)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn((batch, heads, n, dim), generator=gen)  # [batch, heads, n, dim]
    keys = torch.randn((batch, kv_heads, capacity, dim), generator=gen)  # [batch, kv_heads, capacity, dim]
    values = torch.randn((batch, kv_heads, capacity, dim), generator=gen)
    lengths = torch.randint(0, capacity - n + 1, (batch,), generator=gen)  # [batch]
    lengths[0] = 0  # a request with no committed prefix (a prefill)
    lengths[-1] = capacity - n  # and one that fills its cache
    visible = (torch.rand((batch, n, n), generator=gen) < 0.3) | torch.eye(n, dtype=torch.bool)  # [batch, n, n]
    return (*(t.to(DEVICE, dtype) for t in (q, keys, values)), lengths.to(DEVICE), visible.to(DEVICE))


def dense_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """What the target's sdpa path computes, in float32."""
    span = int(lengths.max()) + visible.shape[-1]
    mask = tree_attention_mask(lengths, visible, span)
    k, v = keys[:, :, :span].float(), values[:, :, :span].float()
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale, enable_gqa=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "n", "dim", "capacity"),
    [
        (3, 9, 3, 17, 64, 150),  # the default target's heads, a 16-node tree, prefixes over several key blocks
        (2, 4, 4, 5, 32, 40),  # no grouping
        (2, 6, 3, 70, 48, 160),  # rows over several programs; a head size that is not a power of two
        (1, 2, 1, 1, 16, 20),  # one token (ar's verify)
        (2, 8, 2, 17, 256, 90),  # Qwen3.5's head size: blocks of 32 (shared memory on the GPU)
    ],
)
def test_equals_the_dense_mask_attention(
    batch: int, heads: int, kv_heads: int, n: int, dim: int, capacity: int, dtype: torch.dtype
) -> None:
    q, keys, values, lengths, visible = random_case(batch, heads, kv_heads, n, dim, capacity, dtype, seed=n)
    out = tree_attention(q, keys, values, lengths, visible, scale=0.3)
    assert out.shape == q.shape and out.dtype == dtype
    ref = dense_reference(q, keys, values, lengths, visible, 0.3)
    tolerance = TOLERANCE[dtype] * max(1, dim // 64)  # longer dots, larger logits at this scale: more rounding
    torch.testing.assert_close(out.float(), ref, rtol=tolerance, atol=tolerance)


def test_wide_rows_get_smaller_blocks() -> None:
    assert block_sizes(64, 4) == block_sizes(64, 2) == block_sizes(128, 2) == (64, 64)
    # 64 x 64 tiles of 256 bfloat16 (or 128 float32) need 232 KiB of shared memory, over Hopper's 227
    assert block_sizes(128, 4) == block_sizes(256, 2) == block_sizes(256, 4) == (32, 32)


def test_reads_the_cache_in_place_through_a_narrowed_view() -> None:
    """The session hands the kernel one layer of a cache narrowed to its first rows: strided, not copied."""
    q, keys, values, lengths, visible = random_case(4, 6, 2, 9, 32, 64, torch.float32, seed=3)
    layers_k = torch.stack([torch.zeros_like(keys), keys])[:, :3]  # [layers, rows, kv_heads, capacity, dim]
    layers_v = torch.stack([torch.zeros_like(values), values])[:, :3]
    out = tree_attention(q[:3], layers_k[1], layers_v[1], lengths[:3], visible[:3])
    ref = dense_reference(q[:3], keys[:3], values[:3], lengths[:3], visible[:3], 32**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_each_query_sees_only_the_prefix_and_its_visible_slots() -> None:
    """Poisoning every key a query must not see (past its request's length + n, and invisible tree slots)
    leaves its output unchanged."""
    q, keys, values, lengths, visible = random_case(2, 4, 2, 6, 16, 30, torch.float32, seed=5)
    clean = tree_attention(q, keys, values, lengths, visible)
    poisoned_k, poisoned_v = keys.clone(), values.clone()
    for b in range(2):
        start = int(lengths[b])
        poisoned_k[b, :, start + 6 :] = 1e4
        poisoned_v[b, :, start + 6 :] = 1e4
    only_diagonal = torch.eye(6, dtype=torch.bool, device=DEVICE).expand(2, -1, -1).contiguous()
    diag = tree_attention(q, keys, values, lengths, only_diagonal)
    torch.testing.assert_close(tree_attention(q, poisoned_k, poisoned_v, lengths, visible), clean)
    for b in range(2):  # and an invisible tree slot does change nothing: the diagonal-only mask differs
        start = int(lengths[b])
        poisoned_v[b, :, start + 1 : start + 6] = 1e4  # slots 1.. are invisible to node 0
        torch.testing.assert_close(
            tree_attention(q, keys, poisoned_v, lengths, only_diagonal)[b, :, 0], diag[b, :, 0], rtol=0, atol=0
        )


def test_rejects_heads_that_cannot_share_kv_heads() -> None:
    q, keys, values, lengths, visible = random_case(1, 4, 3, 2, 16, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="4 query heads cannot share 3 KV heads"):
        tree_attention(q, keys[:, :3], values[:, :3], lengths, visible)


def test_resolve_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_attention("sdpa", cpu, f32) == "sdpa"
    assert resolve_attention("auto", cpu, f32) == "sdpa"  # the interpreter is for tests only
    if os.environ.get("TRITON_INTERPRET") == "1":  # the tests' setting on CPU, not with DDTREE_TEST_DEVICE=cuda
        assert resolve_attention("triton", cpu, f32) == "triton"
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        resolve_attention("flash", cpu, f32)
    with pytest.raises(ValueError, match=r"takes float32, bfloat16 or float16, not torch\.float64"):
        resolve_attention("triton", cpu, torch.float64)
    if torch.cuda.is_available():
        assert resolve_attention("auto", torch.device("cuda"), f32) == "triton"
        assert resolve_attention("auto", torch.device("cuda"), torch.float64) == "sdpa"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_attention_available(cpu)
    with pytest.raises(ValueError, match="needs triton and a CUDA device"):
        resolve_attention("triton", cpu, f32)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_engine_with_the_triton_attention_equals_ar(method: str) -> None:
    """Greedy decoding through the kernel (prefill and verify) gives sdpa ar's tokens, and the same steps."""
    from ddtree.engine.engine import Engine
    from ddtree.settings import GenerationConfig
    from tests.helpers import random_prompts, tiny_pair

    target, drafter = tiny_pair(21, vocab=24, block_size=5, dtype=torch.float32)
    prompts = random_prompts(21, 3, vocab=24)
    ar = Engine(target, drafter, attention="sdpa").generate(prompts, GenerationConfig(method="ar", max_new_tokens=16))
    config = GenerationConfig(method=method, budget=8, max_new_tokens=16)
    fused = Engine(target, drafter, attention="triton").generate(prompts, config)
    plain = Engine(target, drafter, attention="sdpa").generate(prompts, config)
    assert [o.token_ids for o in fused.outputs] == [o.token_ids for o in ar.outputs]
    assert [o.acceptance_lengths for o in fused.outputs] == [o.acceptance_lengths for o in plain.outputs]


def test_the_drafter_block_through_the_kernel_equals_sdpa() -> None:
    """The drafter's block attends to its cached context and to itself: in place through the kernel (the
    block's keys in the cache's scratch slots) as with the concatenated keys under a mask."""
    from tests.helpers import tiny_pair

    target, drafter = tiny_pair(4, vocab=24, block_size=5, dtype=torch.float32)
    features = len(drafter.target_layer_ids) * target.hidden_size
    gen = torch.Generator().manual_seed(4)
    context = torch.randn((3, 7, features), generator=gen).to(DEVICE)  # [batch, n, features]
    counts = torch.tensor([7, 2, 5], device=DEVICE)  # real context rows per request
    block = target.embed(torch.randint(0, 24, (3, 5), generator=gen).to(DEVICE))  # [batch, block, hidden]
    outs = []
    for attention in ("sdpa", "triton"):
        cache = drafter.new_cache(3, 32, torch.float32, DEVICE)
        with torch.no_grad():
            outs.append(drafter(block, context, counts, cache, 16, fused=False, attention=attention))
        assert torch.equal(cache.lengths, counts)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
